//! The layer split: which consecutive layers each device of a list (`cpu:0,1`, `cuda:0,1`)
//! holds, and the per-device capacities that `device_memory_mib` configures.
//!
//! The split is generic: the forward pass runs each device's layer range and hands the
//! activations over at the boundary, each device keeps the K/V of its own layers, and every
//! reservation is made in that device's own `MemoryPool`. Two CPU devices with separate budgets
//! exercise all of it without a GPU.

use std::ops::Range;

use crate::error::{Result, StrataError};

/// Splits a comma-separated list, with one entry per device.
fn split_list<'a>(
    field: &str,
    spec: &'a str,
    devices: &[String],
    what: &str,
) -> Result<Vec<&'a str>> {
    let parts: Vec<&str> = spec.split(',').map(str::trim).collect();
    if parts.len() != devices.len() {
        let plural = if parts.len() == 1 { "" } else { "s" };
        return Err(StrataError::invalid(
            field,
            format!(
                "{spec:?}: gives {} {what}{plural} for {} device(s) ({}); give one per device",
                parts.len(),
                devices.len(),
                devices.join(", ")
            ),
        ));
    }
    Ok(parts)
}

/// `device_memory_mib`: each device's capacity in MiB, in the order of the device list, as
/// bytes (rounded down). A value may have decimals ("0.5"): the tests size a device to the byte.
pub fn parse_device_memory(spec: &str, devices: &[String]) -> Result<Vec<u64>> {
    const FIELD: &str = "device_memory_mib";
    let bad = |why: &str| StrataError::invalid(FIELD, format!("{spec:?}: {why}"));
    split_list(FIELD, spec, devices, "value")?
        .into_iter()
        .map(|part| {
            let mib: f64 = part
                .parse()
                .ok()
                .filter(|m: &f64| m.is_finite() && *m > 0.0)
                .ok_or_else(|| bad("values must be numbers of MiB greater than 0"))?;
            let bytes = mib * (1u64 << 20) as f64;
            if bytes >= u64::MAX as f64 {
                return Err(bad(&format!("{part} MiB is too large")));
            }
            // At least one byte: a value so small that it rounds to nothing is still a bound.
            Ok((bytes as u64).max(1))
        })
        .collect()
}

/// `layer_split`: the number of layers of each device, in order. Each at least 1, summing to
/// the model's `num_layers`.
pub fn parse_layer_split(spec: &str, devices: &[String], num_layers: usize) -> Result<Vec<usize>> {
    const FIELD: &str = "layer_split";
    let counts = split_list(FIELD, spec, devices, "count")?
        .into_iter()
        .map(|part| part.parse::<usize>())
        .collect::<std::result::Result<Vec<usize>, _>>()
        .map_err(|_| {
            StrataError::invalid(
                FIELD,
                format!("{spec:?}: counts must be non-negative integers"),
            )
        })?;
    if counts.contains(&0) {
        return Err(StrataError::invalid(
            FIELD,
            format!("{spec:?}: each device needs at least 1 layer"),
        ));
    }
    let total = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c));
    if total != Some(num_layers) {
        let sum = total.map_or_else(|| "more than any model's".to_string(), |t| t.to_string());
        return Err(StrataError::invalid(
            FIELD,
            format!("{spec:?} sums to {sum} layers; the model has {num_layers}"),
        ));
    }
    Ok(counts)
}

/// The split when none is given: layers in proportion to each device's free bytes (largest
/// remainder, at least one layer each), or evenly (earlier devices take the odd layers) when no
/// device's capacity is known.
pub fn default_layer_split(
    devices: &[String],
    free: &[Option<u64>],
    num_layers: usize,
) -> Result<Vec<usize>> {
    let n = devices.len();
    if num_layers < n {
        return Err(StrataError::invalid(
            "device",
            format!(
                "{n} devices ({}) but the model has {num_layers} layer(s); each device needs at \
                 least 1",
                devices.join(", ")
            ),
        ));
    }
    let weights: Vec<u128> = if free.iter().all(Option::is_some) {
        free.iter().map(|f| f.unwrap_or(0) as u128).collect()
    } else {
        vec![1; n]
    };
    let sum: u128 = weights.iter().sum::<u128>().max(1);
    let layers = num_layers as u128;
    let mut counts: Vec<usize> = weights
        .iter()
        .map(|w| ((layers * w / sum) as usize).max(1))
        .collect();
    // Hand out what flooring left, largest remainder first (earlier devices win ties).
    let mut by_remainder: Vec<usize> = (0..n).collect();
    by_remainder.sort_by_key(|&i| std::cmp::Reverse(layers * weights[i] % sum));
    let mut i = 0;
    while counts.iter().sum::<usize>() < num_layers {
        counts[by_remainder[i % n]] += 1;
        i += 1;
    }
    // The one-layer minimum may have overshot: take back from the largest counts.
    while counts.iter().sum::<usize>() > num_layers {
        let Some(largest) = (0..n).max_by_key(|&i| (counts[i], std::cmp::Reverse(i))) else {
            break;
        };
        counts[largest] -= 1;
    }
    Ok(counts)
}

/// Consecutive layer ranges from per-device counts.
pub fn ranges(counts: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    counts
        .iter()
        .map(|&c| {
            let r = start..start + c;
            start += c;
            r
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn devs(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("cpu:{i}")).collect()
    }

    #[test]
    fn parses_device_memory_one_value_per_device() {
        assert_eq!(
            parse_device_memory("300, 120", &devs(2)).unwrap(),
            vec![300 << 20, 120 << 20]
        );
        assert_eq!(
            parse_device_memory("300", &devs(2))
                .unwrap_err()
                .to_string(),
            "device_memory_mib: \"300\": gives 1 value for 2 device(s) (cpu:0, cpu:1); give one \
             per device"
        );
        assert_eq!(
            parse_device_memory("1,2,3", &devs(2))
                .unwrap_err()
                .to_string(),
            "device_memory_mib: \"1,2,3\": gives 3 values for 2 device(s) (cpu:0, cpu:1); give \
             one per device"
        );
        assert_eq!(
            parse_device_memory("0.5,0.0009765625", &devs(2)).unwrap(),
            vec![1 << 19, 1 << 10]
        );
        for bad in ["300,x", "300,0", "300,-1", "300,inf", "300,nan", "300,"] {
            assert_eq!(
                parse_device_memory(bad, &devs(2)).unwrap_err().to_string(),
                format!("device_memory_mib: {bad:?}: values must be numbers of MiB greater than 0")
            );
        }
        assert_eq!(
            parse_device_memory("1e300,1", &devs(2))
                .unwrap_err()
                .to_string(),
            "device_memory_mib: \"1e300,1\": 1e300 MiB is too large"
        );
    }

    #[test]
    fn parses_explicit_layer_splits() {
        assert_eq!(parse_layer_split("3,1", &devs(2), 4).unwrap(), vec![3, 1]);
        assert_eq!(
            parse_layer_split("2,3", &devs(2), 4)
                .unwrap_err()
                .to_string(),
            "layer_split: \"2,3\" sums to 5 layers; the model has 4"
        );
        assert_eq!(
            parse_layer_split("4,0", &devs(2), 4)
                .unwrap_err()
                .to_string(),
            "layer_split: \"4,0\": each device needs at least 1 layer"
        );
        assert_eq!(
            parse_layer_split("4", &devs(2), 4).unwrap_err().to_string(),
            "layer_split: \"4\": gives 1 count for 2 device(s) (cpu:0, cpu:1); give one per \
             device"
        );
        assert_eq!(
            parse_layer_split("2,-2", &devs(2), 4)
                .unwrap_err()
                .to_string(),
            "layer_split: \"2,-2\": counts must be non-negative integers"
        );
        let huge = format!("{},{}", usize::MAX, 1);
        assert!(parse_layer_split(&huge, &devs(2), 4)
            .unwrap_err()
            .to_string()
            .ends_with("sums to more than any model's layers; the model has 4"));
    }

    #[test]
    fn default_split_is_even_or_proportional_to_free_memory() {
        assert_eq!(
            default_layer_split(&devs(2), &[None, None], 5).unwrap(),
            vec![3, 2]
        );
        assert_eq!(
            default_layer_split(&devs(3), &[None; 3], 4).unwrap(),
            vec![2, 1, 1]
        );
        assert_eq!(
            default_layer_split(&devs(2), &[Some(300), Some(100)], 4).unwrap(),
            vec![3, 1]
        );
        assert_eq!(
            default_layer_split(&devs(2), &[Some(100), Some(200)], 30).unwrap(),
            vec![10, 20]
        );
        // A tiny device still gets one layer.
        assert_eq!(
            default_layer_split(&devs(2), &[Some(1_000_000), Some(1)], 4).unwrap(),
            vec![3, 1]
        );
        assert_eq!(default_layer_split(&devs(1), &[None], 7).unwrap(), vec![7]);
        assert_eq!(
            default_layer_split(&devs(3), &[None; 3], 2)
                .unwrap_err()
                .to_string(),
            "device: 3 devices (cpu:0, cpu:1, cpu:2) but the model has 2 layer(s); each device \
             needs at least 1"
        );
        for layers in 2..40 {
            for caps in [[Some(7), Some(3)], [Some(1), Some(1)], [None, None]] {
                let c = default_layer_split(&devs(2), &caps, layers).unwrap();
                assert_eq!(c.iter().sum::<usize>(), layers);
                assert!(c.iter().all(|&n| n >= 1));
            }
        }
    }

    #[test]
    fn ranges_are_consecutive() {
        assert_eq!(ranges(&[3, 1, 2]), vec![0..3, 3..4, 4..6]);
    }
}
