//! `SamplingParams`: keyword arguments checked one by one, so that a wrong type or range raises
//! InvalidRequest naming the argument (never a bare TypeError from the binding layer).

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use super::args::{bad, int, lossy, text, token_ids, type_name};
use super::errors::to_pyerr;
use super::json::py_to_json;
use crate::engine::request::{check_float, float_text, SamplingParams};
use crate::engine::structured::StructuredOutput;

#[pyclass(name = "SamplingParams", module = "strata_rs", frozen)]
#[derive(Clone)]
pub struct PySamplingParams {
    pub inner: SamplingParams,
}

fn float(field: &str, v: &Bound<'_, PyAny>) -> PyResult<f32> {
    if v.is_instance_of::<PyBool>()
        || !(v.is_instance_of::<PyFloat>() || v.is_instance_of::<PyInt>())
    {
        return Err(bad(
            field,
            format!("must be a number, got {}", type_name(v)),
        ));
    }
    // An int beyond a double's range (10**400) cannot be converted at all.
    let x: f64 = v
        .extract()
        .map_err(|_| bad(field, "is out of range (beyond a 64-bit float)"))?;
    // The range is checked on the number sent, before rounding to f32 (which could carry it over a
    // bound); a number too large for an f32 is refused rather than rounded to f32::MAX or inf.
    check_float(field, x, float_text(x)).map_err(to_pyerr)?;
    if x.abs() > f64::from(f32::MAX) {
        return Err(bad(
            field,
            format!(
                "must be at most {:e} (a 32-bit float), got {}",
                f32::MAX,
                float_text(x)
            ),
        ));
    }
    // A nonzero number that rounds to 0 (|x| <= 2**-150) is refused by name where 0 is out of range
    // (top_p, repetition_penalty), rather than as "got 0", a number the caller never sent.
    if x != 0.0 && (x as f32) == 0.0 && check_float(field, 0.0, 0).is_err() {
        return Err(bad(
            field,
            format!(
                "must be more than 2**-150 (a 32-bit float rounds it to 0), got {}",
                float_text(x)
            ),
        ));
    }
    Ok(x as f32)
}

fn boolean(field: &str, v: &Bound<'_, PyAny>) -> PyResult<bool> {
    if !v.is_instance_of::<PyBool>() {
        return Err(bad(field, format!("must be a bool, got {}", type_name(v))));
    }
    v.extract()
}

fn strings(field: &str, v: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(vec![text(field, s)?]);
    }
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        return v
            .try_iter()?
            .map(|item| {
                let item = item?;
                let s = item.cast::<PyString>().map_err(|_| {
                    bad(
                        field,
                        format!(
                            "must be a string or a list of strings, got a {} in the list",
                            type_name(&item)
                        ),
                    )
                })?;
                text(field, s)
            })
            .collect();
    }
    Err(bad(
        field,
        format!(
            "must be a string or a list of strings, got {}",
            type_name(v)
        ),
    ))
}

/// `{token id: bias}`: ids as ints, or as the decimal strings a JSON object's keys are (OpenAI's
/// shape); biases are numbers (ranges are `SamplingParams::validate`'s). Sorted by id.
fn logit_bias(v: &Bound<'_, PyAny>) -> PyResult<Vec<(u32, f32)>> {
    let dict = v.cast::<PyDict>().map_err(|_| {
        bad(
            "logit_bias",
            format!("must be a dict of token id -> bias, got {}", type_name(v)),
        )
    })?;
    let mut out = Vec::with_capacity(dict.len());
    for (key, value) in dict.iter() {
        let id: Option<i64> = if key.is_instance_of::<PyBool>() {
            None
        } else if key.is_instance_of::<PyInt>() {
            key.extract().ok()
        } else if let Ok(s) = key.cast::<PyString>() {
            s.to_str().ok().and_then(|s| s.parse().ok())
        } else {
            None
        };
        let shown = lossy(&key);
        let id = id
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(|| bad("logit_bias", format!("keys must be token ids, got {shown}")))?;
        let field = format!("logit_bias[{id}]");
        let bias = float(&field, &value)?;
        out.push((id, bias));
    }
    out.sort_by_key(|&(id, _)| id);
    out.dedup_by_key(|&mut (id, _)| id);
    Ok(out)
}

/// Applies keyword arguments to `p`, checking each; an unknown keyword is an error.
pub fn apply_kwargs(p: &mut SamplingParams, kwargs: &Bound<'_, PyDict>) -> PyResult<()> {
    for (k, v) in kwargs.iter() {
        // A keyword name is a str, but it may hold a lone surrogate: report it, lossily.
        let key = lossy(&k);
        let none = v.is_none();
        match key.as_str() {
            "max_tokens" => {
                p.max_tokens = if none {
                    None
                } else {
                    Some(int("max_tokens", &v, 1)?)
                }
            }
            "temperature" => p.temperature = float("temperature", &v)?,
            "top_k" => p.top_k = if none { 0 } else { int("top_k", &v, 0)? },
            "top_p" => p.top_p = float("top_p", &v)?,
            "min_p" => p.min_p = float("min_p", &v)?,
            "repetition_penalty" => p.repetition_penalty = float("repetition_penalty", &v)?,
            "presence_penalty" => p.presence_penalty = float("presence_penalty", &v)?,
            "frequency_penalty" => p.frequency_penalty = float("frequency_penalty", &v)?,
            "seed" => {
                p.seed = if none {
                    None
                } else {
                    if v.is_instance_of::<PyBool>() || !v.is_instance_of::<PyInt>() {
                        return Err(bad(
                            "seed",
                            format!("must be an integer, got {}", type_name(&v)),
                        ));
                    }
                    // Any Python int: negative and big seeds are folded into 64 bits.
                    let bits: u64 = match v.extract::<i128>() {
                        Ok(x) => x as u64,
                        Err(_) => return Err(bad("seed", "is out of range")),
                    };
                    Some(bits)
                }
            }
            "stop" => {
                p.stop = if none {
                    Vec::new()
                } else {
                    strings("stop", &v)?
                }
            }
            "stop_token_ids" => {
                p.stop_token_ids = if none {
                    Vec::new()
                } else {
                    token_ids("stop_token_ids", &v)?
                }
            }
            "ignore_eos" => p.ignore_eos = boolean("ignore_eos", &v)?,
            "logprobs" => {
                p.logprobs = match () {
                    _ if none => None,
                    // logprobs=True asks for the chosen token's logprob only (OpenAI's chat form).
                    _ if v.is_instance_of::<PyBool>() => v.extract::<bool>()?.then_some(0),
                    _ => Some(int("logprobs", &v, 0)?),
                }
            }
            "n" => p.n = int("n", &v, 1)?,
            "skip_special_tokens" => p.skip_special_tokens = boolean("skip_special_tokens", &v)?,
            "speculative" => p.speculative = boolean("speculative", &v)?,
            "logit_bias" => {
                p.logit_bias = if none { Vec::new() } else { logit_bias(&v)? };
            }
            "structured_outputs" => {
                p.structured_outputs = if none {
                    None
                } else {
                    let json = py_to_json(&v, "structured_outputs")?;
                    Some(StructuredOutput::from_json(&json).map_err(to_pyerr)?)
                }
            }
            other => return Err(bad(other, "unknown sampling parameter")),
        }
    }
    Ok(())
}

/// The parameters of a call: `params` (a SamplingParams or None), or keyword arguments, not both.
/// `params` is taken as any object so that a wrong type is an InvalidRequest, not a TypeError.
pub fn resolve(
    params: Option<&Bound<'_, PyAny>>,
    kwargs: Option<&Bound<'_, PyDict>>,
    vocab_size: usize,
) -> PyResult<SamplingParams> {
    let params = match params.filter(|p| !p.is_none()) {
        None => None,
        Some(p) => Some(p.cast::<PySamplingParams>().map_err(|_| {
            bad(
                "params",
                format!("must be a SamplingParams or None, got {}", type_name(p)),
            )
        })?),
    };
    let kwargs = kwargs.filter(|k| !k.is_empty());
    let p = match (params, kwargs) {
        (Some(_), Some(_)) => {
            return Err(bad(
                "params",
                "pass either a SamplingParams or keyword arguments, not both",
            ))
        }
        (Some(p), None) => p.get().inner.clone(),
        (None, kw) => {
            let mut p = SamplingParams::default();
            if let Some(kw) = kw {
                apply_kwargs(&mut p, kw)?;
            }
            p
        }
    };
    p.validate(vocab_size).map_err(to_pyerr)?;
    Ok(p)
}

#[pymethods]
impl PySamplingParams {
    /// Keyword arguments only: max_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
    /// presence_penalty, frequency_penalty, seed, stop, stop_token_ids, ignore_eos, logprobs, n,
    /// skip_special_tokens, structured_outputs, logit_bias, speculative. Checked at once; InvalidRequest names the bad
    /// one (a grammar is compiled when the request is submitted).
    #[new]
    // Keywords are read from **kwargs (so that a bad one is an InvalidRequest naming it); the
    // text signature tells Python tools (and the stub check) which there are.
    #[pyo3(
        signature = (**kwargs),
        text_signature = "(*, max_tokens=None, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, \
            repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, seed=None, \
            stop=None, stop_token_ids=None, ignore_eos=False, logprobs=None, n=1, \
            skip_special_tokens=True, structured_outputs=None, logit_bias=None, speculative=True)"
    )]
    fn new(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let mut p = SamplingParams::default();
        if let Some(kw) = kwargs {
            apply_kwargs(&mut p, kw)?;
        }
        // Vocabulary-dependent checks (stop_token_ids) wait for the engine.
        p.validate(usize::MAX).map_err(to_pyerr)?;
        Ok(PySamplingParams { inner: p })
    }

    #[getter]
    fn max_tokens(&self) -> Option<usize> {
        self.inner.max_tokens
    }
    #[getter]
    fn temperature(&self) -> f32 {
        self.inner.temperature
    }
    #[getter]
    fn top_k(&self) -> usize {
        self.inner.top_k
    }
    #[getter]
    fn top_p(&self) -> f32 {
        self.inner.top_p
    }
    #[getter]
    fn min_p(&self) -> f32 {
        self.inner.min_p
    }
    #[getter]
    fn repetition_penalty(&self) -> f32 {
        self.inner.repetition_penalty
    }
    #[getter]
    fn presence_penalty(&self) -> f32 {
        self.inner.presence_penalty
    }
    #[getter]
    fn frequency_penalty(&self) -> f32 {
        self.inner.frequency_penalty
    }
    #[getter]
    fn seed(&self) -> Option<u64> {
        self.inner.seed
    }
    #[getter]
    fn stop(&self) -> Vec<String> {
        self.inner.stop.clone()
    }
    #[getter]
    fn stop_token_ids(&self) -> Vec<u32> {
        self.inner.stop_token_ids.clone()
    }
    #[getter]
    fn ignore_eos(&self) -> bool {
        self.inner.ignore_eos
    }
    #[getter]
    fn logprobs(&self) -> Option<usize> {
        self.inner.logprobs
    }
    #[getter]
    fn n(&self) -> usize {
        self.inner.n
    }
    #[getter]
    fn skip_special_tokens(&self) -> bool {
        self.inner.skip_special_tokens
    }
    #[getter]
    fn speculative(&self) -> bool {
        self.inner.speculative
    }

    fn __repr__(&self) -> String {
        let p = &self.inner;
        format!(
            "SamplingParams(max_tokens={:?}, temperature={}, top_k={}, top_p={}, min_p={}, seed={:?}, stop={:?}, n={}, logprobs={:?})",
            p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.stop, p.n, p.logprobs
        )
    }
}
