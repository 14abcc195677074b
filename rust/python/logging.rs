//! Forwards the core's log records (the `log` crate) to Python's `logging`, under the record's
//! target as logger name (`strata_rs.cache`, ...), so that they land wherever the application
//! sends its logs. The engine thread only queues a record; a forwarder thread takes the GIL to
//! emit it, through the exit gate, so logging never stalls a step nor touches a finalizing
//! interpreter. `STRATA_LOG=debug` also forwards debug records (each cache move).

use std::sync::mpsc::{channel, Sender};

use pyo3::prelude::*;

use super::awaitable::attach_unless_exiting;

struct Record {
    level: u32,
    target: String,
    message: String,
}

struct Forwarder {
    queue: Sender<Record>,
}

impl log::Log for Forwarder {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = match record.level() {
            log::Level::Error => 40,
            log::Level::Warn => 30,
            log::Level::Info => 20,
            log::Level::Debug => 10,
            log::Level::Trace => 5,
        };
        let r = Record {
            level,
            target: record.target().to_string(),
            message: record.args().to_string(),
        };
        // The forwarder is gone only when the process is ending.
        let _ = self.queue.send(r);
    }

    fn flush(&self) {}
}

fn emit(py: Python<'_>, r: &Record) -> PyResult<()> {
    let logger = py
        .import("logging")?
        .call_method1("getLogger", (r.target.as_str(),))?;
    logger.call_method1("log", (r.level, r.message.as_str()))?;
    Ok(())
}

/// Installs the forwarder (once per process; a logger another library installed first wins).
pub fn install() {
    let (tx, rx) = channel::<Record>();
    let forwarder = Forwarder { queue: tx };
    if log::set_boxed_logger(Box::new(forwarder)).is_err() {
        return;
    }
    let debug = std::env::var("STRATA_LOG").is_ok_and(|v| v.eq_ignore_ascii_case("debug"));
    log::set_max_level(if debug {
        log::LevelFilter::Debug
    } else {
        log::LevelFilter::Info
    });
    let spawned = std::thread::Builder::new()
        .name("strata-log".into())
        .spawn(move || {
            for r in rx {
                // A record that cannot be emitted (logging misconfigured, exiting) is dropped.
                let _ = attach_unless_exiting(|py| emit(py, &r));
            }
        });
    if spawned.is_err() {
        log::set_max_level(log::LevelFilter::Off);
    }
}
