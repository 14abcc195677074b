//! Token embedding lookup: one row of the `[vocab, hidden]` matrix, widened to f32.

use super::quant::dequantize_row;
use super::quant::linear::{dequantized_row, Layout, QuantMatRef};
use super::{MatRef, WeightData};
use half::slice::HalfFloatSliceExt;

/// `out` = row `token` of the `[vocab, hidden]` embedding matrix, converted to f32.
pub fn embed(w: MatRef, token: u32, out: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let t = token as usize;
    assert!(t < rows, "embed: token {token} out of range (vocab {rows})");
    assert_eq!(out.len(), cols, "embed: out is not [hidden]");
    let range = t * cols..(t + 1) * cols;
    match w.data {
        WeightData::F32(d) => out.copy_from_slice(&d[range]),
        // bf16 is the top half of an f32: a shift, which the compiler vectorises.
        WeightData::Bf16(d) => {
            for (o, v) in out.iter_mut().zip(&d[range]) {
                *o = f32::from_bits((v.to_bits() as u32) << 16);
            }
        }
        // half picks F16C at run time when the CPU has it.
        WeightData::F16(d) => d[range].convert_to_f32_slice(out),
        WeightData::Quant(q, d) => {
            let rb = d.len() / rows;
            dequantize_row(q, &d[t * rb..(t + 1) * rb], out);
        }
        // A tied head interleaved for the x86 kernels: the row's blocks, one by one.
        WeightData::Interleaved(ty, data) => {
            let w = QuantMatRef {
                ty,
                layout: Layout::Interleaved,
                data,
                rows,
                cols,
            };
            dequantized_row(&w, t, out);
        }
    }
}

/// Plain reference: element-wise conversion.
pub fn reference(w: MatRef, token: u32, out: &mut [f32]) {
    if let WeightData::Quant(..) | WeightData::Interleaved(..) = w.data {
        // The block formats have one definition: dequantize_row is the reference.
        return embed(w, token, out);
    }
    let base = token as usize * w.cols;
    for (c, o) in out.iter_mut().enumerate() {
        *o = match w.data {
            WeightData::F32(d) => d[base + c],
            WeightData::F16(d) => d[base + c].to_f32(),
            WeightData::Bf16(d) => d[base + c].to_f32(),
            WeightData::Quant(..) | WeightData::Interleaved(..) => unreachable!("handled above"),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    use crate::model::kernels::cpu::test_rng::Rng;

    #[test]
    fn matches_reference_exactly() {
        let mut rng = Rng(42);
        for &(vocab, hidden) in &[(7usize, 33usize), (50, 64), (3, 1)] {
            let wf: Vec<f32> = (0..vocab * hidden).map(|_| 100.0 * rng.signed()).collect();
            let wh: Vec<f16> = wf.iter().map(|&v| f16::from_f32(v)).collect();
            let wb: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
            for data in [
                WeightData::F32(&wf),
                WeightData::F16(&wh),
                WeightData::Bf16(&wb),
            ] {
                let w = MatRef {
                    data,
                    rows: vocab,
                    cols: hidden,
                };
                for tok in [0, vocab as u32 / 2, vocab as u32 - 1] {
                    let mut got = vec![f32::NAN; hidden];
                    let mut want = vec![0.0; hidden];
                    embed(w, tok, &mut got);
                    reference(w, tok, &mut want);
                    // Widening conversions are exact: tolerance 0.
                    assert_eq!(got, want);
                }
            }
        }
    }

    #[test]
    #[should_panic]
    fn token_out_of_range_panics() {
        let w = [0.0f32; 6];
        let m = MatRef {
            data: WeightData::F32(&w),
            rows: 2,
            cols: 3,
        };
        embed(m, 2, &mut [0.0; 3]);
    }
}
