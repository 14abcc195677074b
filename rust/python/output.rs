//! What generation returns to Python: `StreamChunk` (one per stream step), `Completion` (a whole
//! answer), `Choice` and `Usage`. Plain read-only objects built from the core's deltas.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::engine::request::{Delta, FinishReason, PromptTokenLogprob, TokenLogprob, Usage};
use crate::model::tokenizer::Tokenizer;

/// An optional string as Python's repr writes it.
fn py_str(s: Option<&str>) -> String {
    s.map_or_else(|| "None".into(), |s| format!("{s:?}"))
}

#[pyclass(name = "Usage", module = "strata_rs", frozen, get_all)]
#[derive(Clone)]
pub struct PyUsage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose K/V came from the cache.
    pub cached_tokens: usize,
    /// Draft tokens proposed and accepted (speculative decoding), summed over choices.
    pub draft_tokens: usize,
    pub accepted_draft_tokens: usize,
}

#[pymethods]
impl PyUsage {
    fn __repr__(&self) -> String {
        format!(
            "Usage(prompt_tokens={}, completion_tokens={}, cached_tokens={}, draft_tokens={}, \
             accepted_draft_tokens={})",
            self.prompt_tokens,
            self.completion_tokens,
            self.cached_tokens,
            self.draft_tokens,
            self.accepted_draft_tokens
        )
    }
}

impl From<Usage> for PyUsage {
    fn from(u: Usage) -> Self {
        PyUsage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            cached_tokens: u.cached_tokens,
            draft_tokens: u.draft_tokens,
            accepted_draft_tokens: u.accepted_draft_tokens,
        }
    }
}

/// `[{"token_id", "token", "logprob", "top_logprobs": [{"token_id", "token", "logprob"}]}]`.
fn logprobs_list<'py>(
    py: Python<'py>,
    tok: &Tokenizer,
    lps: &[TokenLogprob],
) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for lp in lps {
        list.append(logprob_dict(py, tok, lp)?)?;
    }
    Ok(list)
}

/// `{"token_id", "token", "logprob", "top_logprobs": [{"token_id", "token", "logprob"}]}`.
fn logprob_dict<'py>(
    py: Python<'py>,
    tok: &Tokenizer,
    lp: &TokenLogprob,
) -> PyResult<Bound<'py, PyDict>> {
    let entry = |id: u32, p: f32| -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("token_id", id)?;
        d.set_item("token", tok.decode(&[id], false).unwrap_or_default())?;
        d.set_item("logprob", p)?;
        Ok(d)
    };
    let d = entry(lp.token, lp.logprob)?;
    let top = PyList::empty(py);
    for &(id, p) in &lp.top {
        top.append(entry(id, p)?)?;
    }
    d.set_item("top_logprobs", top)?;
    Ok(d)
}

/// A prompt's entries: None for its first token (nothing comes before it), then each token's
/// entry as a generated token's, with its `rank` (1 + how many tokens were more likely).
pub fn prompt_logprobs_list<'py>(
    py: Python<'py>,
    tok: &Tokenizer,
    entries: &[PromptTokenLogprob],
) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    list.append(py.None())?;
    for entry in entries {
        let d = logprob_dict(py, tok, &entry.logprob)?;
        d.set_item("rank", entry.rank)?;
        list.append(d)?;
    }
    Ok(list)
}

#[pyclass(name = "StreamChunk", module = "strata_rs", frozen, get_all)]
pub struct PyStreamChunk {
    /// Which choice (0..n) this chunk belongs to.
    pub index: usize,
    pub text: String,
    pub token_ids: Vec<u32>,
    /// One entry per token id when logprobs were asked for, else None.
    pub logprobs: Option<Py<PyList>>,
    /// "stop", "length" or "cancelled" on the choice's last chunk, else None.
    pub finish_reason: Option<&'static str>,
    /// On the stream's last chunk.
    pub usage: Option<Py<PyUsage>>,
}

#[pymethods]
impl PyStreamChunk {
    fn __repr__(&self) -> String {
        format!(
            "StreamChunk(index={}, text={:?}, token_ids={:?}, finish_reason={})",
            self.index,
            self.text,
            self.token_ids,
            py_str(self.finish_reason)
        )
    }
}

pub fn chunk(
    py: Python<'_>,
    tok: &Arc<Tokenizer>,
    d: Delta,
    want_logprobs: bool,
) -> PyResult<PyStreamChunk> {
    Ok(PyStreamChunk {
        index: d.index,
        logprobs: if want_logprobs {
            Some(logprobs_list(py, tok, &d.logprobs)?.unbind())
        } else {
            None
        },
        text: d.text,
        token_ids: d.token_ids,
        finish_reason: d.finish_reason.map(FinishReason::name),
        usage: d.usage.map(|u| Py::new(py, PyUsage::from(u))).transpose()?,
    })
}

/// One choice of a finished completion, accumulated from its deltas.
#[derive(Default)]
pub struct ChoiceAcc {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    pub finish_reason: Option<FinishReason>,
}

impl ChoiceAcc {
    pub fn add(&mut self, d: Delta) {
        self.text.push_str(&d.text);
        self.token_ids.extend(d.token_ids);
        self.logprobs.extend(d.logprobs);
        if d.finish_reason.is_some() {
            self.finish_reason = d.finish_reason;
        }
    }
}

#[pyclass(name = "Choice", module = "strata_rs", frozen, get_all)]
pub struct PyChoice {
    pub index: usize,
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Option<Py<PyList>>,
    pub finish_reason: Option<&'static str>,
}

#[pymethods]
impl PyChoice {
    fn __repr__(&self) -> String {
        format!(
            "Choice(index={}, text={:?}, finish_reason={})",
            self.index,
            self.text,
            py_str(self.finish_reason)
        )
    }
}

/// A whole answer. `text`, `token_ids`, `logprobs` and `finish_reason` are those of choice 0;
/// `choices` holds every choice when `n > 1`.
#[pyclass(name = "Completion", module = "strata_rs", frozen, get_all)]
pub struct PyCompletion {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Option<Py<PyList>>,
    pub finish_reason: Option<&'static str>,
    pub usage: Py<PyUsage>,
    pub choices: Vec<Py<PyChoice>>,
}

#[pymethods]
impl PyCompletion {
    fn __repr__(&self) -> String {
        format!(
            "Completion(text={:?}, finish_reason={}, choices={})",
            self.text,
            py_str(self.finish_reason),
            self.choices.len()
        )
    }
}

pub fn completion(
    py: Python<'_>,
    tok: &Arc<Tokenizer>,
    choices: Vec<ChoiceAcc>,
    usage: Usage,
    want_logprobs: bool,
) -> PyResult<PyCompletion> {
    let mut out = Vec::with_capacity(choices.len());
    for (index, c) in choices.into_iter().enumerate() {
        let logprobs = if want_logprobs {
            Some(logprobs_list(py, tok, &c.logprobs)?.unbind())
        } else {
            None
        };
        out.push(Py::new(
            py,
            PyChoice {
                index,
                text: c.text,
                token_ids: c.token_ids,
                logprobs,
                finish_reason: c.finish_reason.map(FinishReason::name),
            },
        )?);
    }
    let first = out
        .first()
        .ok_or_else(|| pyo3::exceptions::PyRuntimeError::new_err("a completion without choices"))?
        .get();
    Ok(PyCompletion {
        text: first.text.clone(),
        token_ids: first.token_ids.clone(),
        logprobs: first.logprobs.as_ref().map(|l| l.clone_ref(py)),
        finish_reason: first.finish_reason,
        usage: Py::new(py, PyUsage::from(usage))?,
        choices: out,
    })
}
