//! `Tokenizer`: encode, decode and the model's chat template.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;

use super::args::Flag;
use super::errors::to_pyerr;
use super::json::py_to_json;
use crate::model::tokenizer::Tokenizer;

#[pyclass(name = "Tokenizer", module = "strata_rs", frozen)]
pub struct PyTokenizer {
    pub inner: Arc<Tokenizer>,
}

#[pymethods]
impl PyTokenizer {
    /// Loads a tokenizer (no weights): a GGUF file's, or a model folder's tokenizer files.
    #[staticmethod]
    fn load(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        Self::from_dir(py, path)
    }

    /// Loads the tokenizer files of a model folder (or a GGUF file's tokenizer; no weights).
    #[staticmethod]
    fn from_dir(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let tok = py.detach(|| Tokenizer::load(&path)).map_err(to_pyerr)?;
        Ok(PyTokenizer {
            inner: Arc::new(tok),
        })
    }

    #[pyo3(signature = (text, add_special_tokens = true))]
    fn encode(&self, py: Python<'_>, text: &str, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        let text = text.to_owned();
        py.detach(|| self.inner.encode(&text, add_special_tokens))
            .map_err(to_pyerr)
    }

    #[pyo3(signature = (ids, skip_special_tokens = false))]
    fn decode(&self, py: Python<'_>, ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        py.detach(|| self.inner.decode(&ids, skip_special_tokens))
            .map_err(to_pyerr)
    }

    /// Renders the model's chat template, as transformers' apply_chat_template(tokenize=False).
    #[pyo3(signature = (messages, add_generation_prompt = Flag::Value(true), **kwargs))]
    fn apply_chat_template(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        add_generation_prompt: Flag,
        kwargs: Option<&Bound<'_, pyo3::types::PyDict>>,
    ) -> PyResult<String> {
        let add_generation_prompt = add_generation_prompt.get("add_generation_prompt")?;
        let messages = py_to_json(messages, "messages")?;
        let extra = kwargs
            .map(|k| py_to_json(k.as_any(), "kwargs"))
            .transpose()?;
        py.detach(|| {
            self.inner
                .apply_chat_template(&messages, add_generation_prompt, extra.as_ref())
        })
        .map_err(to_pyerr)
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.inner.eos_token_ids().to_vec()
    }

    #[getter]
    fn bos_token_id(&self) -> Option<u32> {
        self.inner.bos_token_id()
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    fn __repr__(&self) -> String {
        format!("Tokenizer(vocab_size={})", self.inner.vocab_size())
    }
}
