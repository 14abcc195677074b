//! Fault injection for the cache's moves: fail the Nth allocation, copy, write or read, so that
//! tests can walk every failure path of every move and see the request still answered.
//!
//! Spec: comma-separated rules, each `kind:WHEN`, e.g. `"copy_in:2,read:*,ram_gate:10-40"`.
//! WHEN is `N` (the Nth operation of that kind fails, counting from 1), `A-B` (operations A to B
//! fail: a window in which, say, the RAM gate refuses), `P%` (each operation fails with
//! probability P percent, drawn from a fixed-seed generator, so a run repeats) or `*` (every one
//! fails). Kinds: `alloc` (a host-tier block), `copy_out` (device -> host), `copy_in` (host ->
//! device), `write` (a disk file), `read` (a disk file), `ram_gate` (a RAM gate check refuses as
//! if the memory telemetry could not be read).

use crate::error::{Result, StrataError};
use crate::rng::Rng;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    Alloc,
    CopyOut,
    CopyIn,
    Write,
    Read,
    RamGate,
}

const KINDS: [(FaultKind, &str); 6] = [
    (FaultKind::Alloc, "alloc"),
    (FaultKind::CopyOut, "copy_out"),
    (FaultKind::CopyIn, "copy_in"),
    (FaultKind::Write, "write"),
    (FaultKind::Read, "read"),
    (FaultKind::RamGate, "ram_gate"),
];

impl FaultKind {
    pub fn name(self) -> &'static str {
        KINDS[self as usize].1
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum When {
    Nth(u64),
    Range(u64, u64),
    /// Probability in millionths.
    Chance(u64),
    Always,
}

#[derive(Clone, Debug)]
pub struct Faults {
    rules: Vec<(FaultKind, When)>,
    /// Operations seen so far, per kind.
    seen: [u64; KINDS.len()],
    /// xorshift64 state for `P%` rules; fixed seed, so a spec fails the same operations each run.
    rng: Rng,
}

/// No rules: nothing fails.
impl Default for Faults {
    fn default() -> Self {
        Faults {
            rules: Vec::new(),
            seen: [0; KINDS.len()],
            rng: Rng(SEED),
        }
    }
}

const SEED: u64 = 0x9E37_79B9_7F4A_7C15;

fn parse_when(when: &str) -> std::result::Result<When, String> {
    let count = |n: &str| match n.trim().parse::<u64>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err("N must be an integer >= 1 or *".to_string()),
    };
    if when == "*" {
        return Ok(When::Always);
    }
    if let Some(p) = when.strip_suffix('%') {
        return match p.trim().parse::<f64>() {
            Ok(p) if p > 0.0 && p <= 100.0 => Ok(When::Chance((p * 1e4).round() as u64)),
            _ => Err("P% must have P in (0, 100]".to_string()),
        };
    }
    if let Some((a, b)) = when.split_once('-') {
        let (a, b) = (count(a)?, count(b)?);
        if a > b {
            return Err("the range A-B needs A <= B".to_string());
        }
        return Ok(When::Range(a, b));
    }
    count(when).map(When::Nth)
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
                    bad("the kind must be alloc, copy_out, copy_in, write, read or ram_gate".into())
                })?;
            rules.push((kind, parse_when(when).map_err(bad)?));
        }
        Ok(Faults {
            rules,
            seen: [0; KINDS.len()],
            rng: Rng(SEED),
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
        let mut fail = false;
        for &(k, w) in &self.rules {
            if k != kind {
                continue;
            }
            fail |= match w {
                When::Always => true,
                When::Nth(m) => m == n,
                When::Range(a, b) => (a..=b).contains(&n),
                When::Chance(millionths) => self.rng.next_u() % 1_000_000 < millionths,
            };
        }
        fail
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
    fn a_range_fails_a_window_of_operations() {
        let mut f = Faults::parse("ram_gate:3-5", "cache_faults").unwrap();
        let checks: Vec<bool> = (0..7).map(|_| f.fails(FaultKind::RamGate)).collect();
        assert_eq!(checks, [false, false, true, true, true, false, false]);
    }

    #[test]
    fn a_chance_fails_about_that_share_and_repeats_run_to_run() {
        let run = || {
            let mut f = Faults::parse("write:10%", "cache_faults").unwrap();
            (0..10_000)
                .map(|_| f.fails(FaultKind::Write))
                .collect::<Vec<bool>>()
        };
        let first = run();
        let failed = first.iter().filter(|&&x| x).count();
        assert!((850..=1150).contains(&failed), "{failed} of 10000 failed");
        assert_eq!(first, run(), "the same spec fails the same operations");
        let mut all = Faults::parse("read:100%", "cache_faults").unwrap();
        assert!((0..100).all(|_| all.fails(FaultKind::Read)));
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
            "cache_faults: \"disk:1\": the kind must be alloc, copy_out, copy_in, write, read or ram_gate"
        );
        assert_eq!(
            msg("read:0"),
            "cache_faults: \"read:0\": N must be an integer >= 1 or *"
        );
        assert_eq!(
            msg("read:5-2"),
            "cache_faults: \"read:5-2\": the range A-B needs A <= B"
        );
        assert_eq!(
            msg("write:0%"),
            "cache_faults: \"write:0%\": P% must have P in (0, 100]"
        );
        assert_eq!(
            msg("write:x-3"),
            "cache_faults: \"write:x-3\": N must be an integer >= 1 or *"
        );
    }
}
