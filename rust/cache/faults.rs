//! Fault injection for the cache's moves: fail the Nth allocation, copy, write or read, so that
//! tests can walk every failure path of every move and see the request still answered.
//!
//! Spec: comma-separated `kind:N` (the Nth operation of that kind fails, counting from 1) or
//! `kind:*` (every one fails), e.g. `"copy_in:2,read:*"`. Kinds: `alloc` (a host-tier block),
//! `copy_out` (device -> host), `copy_in` (host -> device), `write` (a disk file), `read` (a disk
//! file).

use crate::error::{Result, StrataError};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    Alloc,
    CopyOut,
    CopyIn,
    Write,
    Read,
}

const KINDS: [(FaultKind, &str); 5] = [
    (FaultKind::Alloc, "alloc"),
    (FaultKind::CopyOut, "copy_out"),
    (FaultKind::CopyIn, "copy_in"),
    (FaultKind::Write, "write"),
    (FaultKind::Read, "read"),
];

impl FaultKind {
    pub fn name(self) -> &'static str {
        KINDS[self as usize].1
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum When {
    Nth(u64),
    Always,
}

#[derive(Clone, Debug, Default)]
pub struct Faults {
    rules: Vec<(FaultKind, When)>,
    /// Operations seen so far, per kind.
    seen: [u64; 5],
}

impl Faults {
    /// Parses a spec; `field` names the option in errors (`cache_faults` or the env var).
    pub fn parse(spec: &str, field: &str) -> Result<Faults> {
        let mut rules = Vec::new();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let bad = |why: String| StrataError::invalid(field, format!("{part:?}: {why}"));
            let (kind, when) = part
                .split_once(':')
                .ok_or_else(|| bad("expected kind:N or kind:*".into()))?;
            let kind = KINDS
                .iter()
                .find(|(_, name)| *name == kind)
                .map(|(k, _)| *k)
                .ok_or_else(|| {
                    bad("the kind must be alloc, copy_out, copy_in, write or read".into())
                })?;
            let when = match when {
                "*" => When::Always,
                n => match n.parse::<u64>() {
                    Ok(n) if n >= 1 => When::Nth(n),
                    _ => return Err(bad("N must be an integer >= 1 or *".into())),
                },
            };
            rules.push((kind, when));
        }
        Ok(Faults {
            rules,
            seen: [0; 5],
        })
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Counts one operation of `kind`; true when it must fail.
    pub fn fails(&mut self, kind: FaultKind) -> bool {
        if self.rules.is_empty() {
            return false;
        }
        let seen = &mut self.seen[kind as usize];
        *seen += 1;
        let n = *seen;
        self.rules.iter().any(|&(k, w)| {
            k == kind
                && match w {
                    When::Always => true,
                    When::Nth(m) => m == n,
                }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nth_and_every_operation_fail_per_kind() {
        let mut f = Faults::parse("copy_in:2, read:*", "cache_faults").unwrap();
        let copies: Vec<bool> = (0..4).map(|_| f.fails(FaultKind::CopyIn)).collect();
        assert_eq!(copies, [false, true, false, false]);
        assert!(f.fails(FaultKind::Read) && f.fails(FaultKind::Read));
        assert!(!f.fails(FaultKind::Write) && !f.fails(FaultKind::Alloc));
        assert!(!f.fails(FaultKind::CopyOut), "kinds count apart");
        let mut none = Faults::parse("", "cache_faults").unwrap();
        assert!(none.is_empty() && !none.fails(FaultKind::CopyIn));
    }

    #[test]
    fn bad_specs_name_the_field_and_the_part() {
        let msg = |s: &str| Faults::parse(s, "cache_faults").unwrap_err().to_string();
        assert_eq!(
            msg("copy_in"),
            "cache_faults: \"copy_in\": expected kind:N or kind:*"
        );
        assert_eq!(
            msg("disk:1"),
            "cache_faults: \"disk:1\": the kind must be alloc, copy_out, copy_in, write or read"
        );
        assert_eq!(
            msg("read:0"),
            "cache_faults: \"read:0\": N must be an integer >= 1 or *"
        );
    }
}
