//! N-gram drafts (prompt lookup): the longest suffix of a sequence that occurred earlier in it
//! proposes the tokens that followed that occurrence. Free to compute, and right often in long
//! conversations, where answers quote and edit what came before.
//!
//! Also what decides how many drafts to try. Checking a draft costs a row of the step, and what
//! a row costs depends on the machine: where decode is bound by reading the weights (a GPU, a
//! large model) extra rows are nearly free; where it is bound by arithmetic (a small model on a
//! CPU without wide integer dot products) every row costs about as much as the first, and no
//! acceptance rate pays for drafts. So each sequence keeps its acceptance rate, the engine keeps
//! the measured time of decode steps by their number of rows ([`StepCosts`]), and a sequence
//! drafts the number of tokens that gives the step (its batch) the most expected tokens per
//! second ([`best_draft_len`]), none when plain decoding is faster, then one draft now and then
//! so that the estimate can recover ([`DraftLength::probe`]); with a draft model, one whose
//! drafts stay rejected stops for good ([`DraftLength::stays_rejected`]). Without the adaptive
//! policy (measurements), a sequence whose drafts are all rejected drafts fewer, and none for
//! a while after a run of rejections ([`DraftLength::take`]).

/// Drafting settings, the same for every sequence of an engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftOptions {
    /// Whether a draft model proposes (the runner's `DraftModel`) instead of the lookup.
    pub model: bool,
    /// Most drafts per step.
    pub max_drafts: usize,
    /// Shortest and longest suffix looked up (the lookup only).
    pub min_n: usize,
    pub max_n: usize,
    /// Draft only as many as pay for their rows ([`best_draft_len`]); false: every draft
    /// lookup proposes (for tests and measurements that need drafts to run).
    pub adaptive: bool,
}

/// Up to `max` tokens proposed to follow `tokens`: those after the latest earlier occurrence of
/// its longest suffix of `min_n..=max_n` tokens. Empty when no suffix occurred before.
pub fn propose(tokens: &[u32], options: &DraftOptions, max: usize, out: &mut Vec<u32>) {
    out.clear();
    if max == 0 {
        return;
    }
    let len = tokens.len();
    for n in (options.min_n..=options.max_n.min(len.saturating_sub(1))).rev() {
        if n == 0 {
            break;
        }
        let suffix = &tokens[len - n..];
        // The latest occurrence that ends before the suffix itself starts to overlap it: its
        // continuation is known. Scanned from the end: recent text is the better guess.
        let found = (0..len - n)
            .rev()
            .find(|&start| &tokens[start..start + n] == suffix);
        if let Some(start) = found {
            let from = start + n;
            let to = (from + max).min(len);
            out.extend_from_slice(&tokens[from..to]);
            return;
        }
    }
}

/// Measured seconds of decode steps, by the rows they fed (an exponential moving average per
/// row count): what a step with a sequence's drafts would cost.
#[derive(Clone, Debug, Default)]
pub struct StepCosts {
    seconds: Vec<Option<f64>>,
}

/// Weight of a new measurement in [`StepCosts`]' averages.
const COST_WEIGHT: f64 = 0.2;

impl StepCosts {
    /// Records a decode step (every row a decode row or a draft) of `rows` rows.
    pub fn record(&mut self, rows: usize, seconds: f64) {
        if rows == 0 || !seconds.is_finite() {
            return;
        }
        if self.seconds.len() <= rows {
            self.seconds.resize(rows + 1, None);
        }
        let slot = &mut self.seconds[rows];
        *slot = Some(match *slot {
            Some(old) => old + COST_WEIGHT * (seconds - old),
            None => seconds,
        });
    }

    pub fn get(&self, rows: usize) -> Option<f64> {
        self.seconds.get(rows).copied().flatten()
    }
}

/// A decode step as planned so far, which the next sequence's drafts are weighed against: its
/// rows, and the tokens it is expected to give (one per decode row, plus the drafts planned so
/// far that are expected to be accepted).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepSoFar {
    pub rows: usize,
    pub tokens: f64,
}

/// Of `0..=available` drafts for a sequence whose drafts are accepted at `rate` each (a draft
/// counts only if those before it were accepted), the number with the most expected tokens per
/// second of the whole step, added to `step`. The step's tokens count, not the sequence's: in a
/// batch every row a draft adds slows every sequence of the step, so a draft pays only if it
/// gives the batch more than its rows cost it (alone, the two are the same). A row count not
/// measured yet is taken to cost what `step.rows` rows cost (so it is tried, and measured).
/// `None` while `step.rows` itself is not measured: the sequence drafts none, so that the step
/// measures it (what drafts cost is always weighed against a measured step without them; a
/// sequence whose drafts were always accepted would otherwise never run one, however dear its
/// drafts).
pub fn best_draft_len(
    costs: &StepCosts,
    step: StepSoFar,
    available: usize,
    rate: f64,
) -> Option<usize> {
    let base = costs.get(step.rows)?;
    let mut best = (0, step.tokens / base);
    let mut expected = step.tokens;
    let mut reach = 1.0;
    for k in 1..=available {
        reach *= rate;
        expected += reach;
        let cost = costs.get(step.rows + k).unwrap_or(base);
        let speed = expected / cost;
        if speed > best.1 {
            best = (k, speed);
        }
    }
    Some(best.0)
}

/// Drafts expected to be accepted of `n` accepted at `rate` each (a draft counts only if those
/// before it were accepted).
pub fn expected_accepted(n: usize, rate: f64) -> f64 {
    (1..=n).map(|m| rate.powi(m as i32)).sum()
}

/// A sequence's drafting state: the estimated chance that a draft is accepted; without the
/// adaptive policy, how many drafts it tries next ([`DraftLength::take`]: halved when none of a
/// step's drafts were accepted, grown by one when all were; at zero, drafting pauses for a
/// number of steps that doubles with each pause, up to `MAX_PAUSE`, then tries one draft
/// again); with it, when to check a draft that the costs say does not pay
/// ([`DraftLength::probe`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DraftLength {
    next: usize,
    /// Steps left before drafting again.
    paused: u32,
    /// Length of the next pause.
    pause: u32,
    /// Steps with drafts on offer left before the next probe, and the wait after it.
    probe_wait: u32,
    probe_gap: u32,
    /// Decayed counts of drafts accepted and of drafts checked (a draft after a rejected one is
    /// not checked): their ratio estimates the chance that the next draft is accepted.
    accepted: f64,
    checked: f64,
}

const FIRST_PAUSE: u32 = 4;
/// How much of the acceptance counts each verification keeps (about the last 10 count).
const RATE_DECAY: f64 = 0.9;
const MAX_PAUSE: u32 = 128;
/// Below this estimated acceptance a draft barely pays for its verification row, and a draft
/// model costs its catch-up on every token besides (`Scheduler::draft` detaches it).
const DETACH_RATE: f64 = 0.1;

impl DraftLength {
    pub fn new(max_drafts: usize) -> Self {
        DraftLength {
            next: max_drafts,
            paused: 0,
            pause: FIRST_PAUSE,
            probe_wait: FIRST_PAUSE,
            probe_gap: 2 * FIRST_PAUSE,
            // A prior of one accepted draft in two.
            accepted: 1.0,
            checked: 2.0,
        }
    }

    /// The estimated chance that a draft is accepted.
    pub fn rate(&self) -> f64 {
        self.accepted / self.checked
    }

    /// Whether the drafts have stayed rejected long enough to stop drafting for good: the
    /// estimate is below `DETACH_RATE`, which from the prior takes about six rejected checks
    /// in a row (with the pauses between them, some 30 steps).
    pub fn stays_rejected(&self) -> bool {
        self.rate() < DETACH_RATE
    }

    /// Drafts to try this step (0 while paused).
    pub fn take(&mut self) -> usize {
        if self.paused > 0 {
            self.paused -= 1;
            return 0;
        }
        self.next
    }

    /// With the adaptive policy, for a step at which no draft pays at the estimated rate
    /// (drafts on offer): whether to check one all the same. The estimate moves only when
    /// drafts are checked, so one that fell low (or a long context that made rows cheap)
    /// would otherwise never be revised. The first after `FIRST_PAUSE` such steps, each later
    /// one after twice the wait before, up to `MAX_PAUSE` (so a sequence whose drafts never
    /// pay spends one row in some 128 steps), and back to the shortest wait once the costs
    /// choose drafts again ([`DraftLength::chosen`]).
    pub fn probe(&mut self) -> bool {
        if self.probe_wait > 1 {
            self.probe_wait -= 1;
            return false;
        }
        self.probe_wait = self.probe_gap;
        self.probe_gap = (self.probe_gap * 2).min(MAX_PAUSE);
        true
    }

    /// The costs chose drafts at this step: the next probe comes after the shortest wait.
    pub fn chosen(&mut self) {
        self.probe_wait = FIRST_PAUSE;
        self.probe_gap = 2 * FIRST_PAUSE;
    }

    /// Records a step's outcome: `accepted` of `proposed` drafts.
    pub fn update(&mut self, proposed: usize, accepted: usize, max_drafts: usize) {
        if proposed == 0 {
            return;
        }
        let checked = (accepted + 1).min(proposed);
        self.accepted = RATE_DECAY * self.accepted + accepted as f64;
        self.checked = RATE_DECAY * self.checked + checked as f64;
        if accepted == proposed {
            self.next = (self.next + 1).min(max_drafts);
            self.pause = FIRST_PAUSE;
        } else if accepted == 0 {
            self.next /= 2;
            if self.next == 0 {
                self.paused = self.pause;
                self.pause = (self.pause * 2).min(MAX_PAUSE);
                self.next = 1;
            }
        } else {
            // Partly accepted: one past what was, so the length keeps probing; the expected
            // gain against the cost of the rows (`best_draft_len`) decides how many run.
            self.next = (accepted + 1).min(max_drafts);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPTIONS: DraftOptions = DraftOptions {
        model: false,
        max_drafts: 4,
        min_n: 1,
        max_n: 3,
        adaptive: true,
    };

    fn drafts(tokens: &[u32], max: usize) -> Vec<u32> {
        let mut out = Vec::new();
        propose(tokens, &OPTIONS, max, &mut out);
        out
    }

    #[test]
    fn the_longest_suffix_seen_before_proposes_what_followed_it() {
        // "1 2 3" occurred before, followed by 4 5 6 7; "3" alone was followed by 9 later on.
        let tokens = [1, 2, 3, 4, 5, 6, 7, 3, 9, 1, 2, 3];
        assert_eq!(drafts(&tokens, 4), vec![4, 5, 6, 7]);
        assert_eq!(drafts(&tokens, 2), vec![4, 5]);
        assert_eq!(drafts(&tokens, 0), Vec::<u32>::new());
    }

    #[test]
    fn the_latest_occurrence_wins_and_drafts_stop_at_the_end() {
        // "8" occurs twice before the end; the later one is followed by 2 then the end.
        let tokens = [8, 1, 1, 8, 2, 8];
        assert_eq!(drafts(&tokens, 4), vec![2, 8]);
    }

    #[test]
    fn no_earlier_occurrence_no_drafts() {
        assert_eq!(drafts(&[1, 2, 3, 4], 4), Vec::<u32>::new());
        assert_eq!(drafts(&[5], 4), Vec::<u32>::new());
        assert_eq!(drafts(&[], 4), Vec::<u32>::new());
        let long_only = DraftOptions {
            model: false,
            max_drafts: 4,
            min_n: 2,
            max_n: 3,
            adaptive: true,
        };
        // Only a 1-token suffix ("3") repeats: below min_n.
        let mut out = vec![99];
        propose(&[3, 7, 1, 3], &long_only, 4, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn a_repeating_run_proposes_itself() {
        // The suffix overlaps its earlier occurrence: 5 5 5 -> 5 5 5 ...
        assert_eq!(drafts(&[5, 5, 5, 5], 3), vec![5]);
        assert_eq!(drafts(&[1, 2, 1, 2, 1, 2], 4), vec![1, 2]);
    }

    const ALONE: StepSoFar = StepSoFar {
        rows: 1,
        tokens: 1.0,
    };

    #[test]
    fn drafts_are_tried_only_where_they_pay_for_their_rows() {
        let mut costs = StepCosts::default();
        // The step without drafts not measured: none, so that it is.
        assert_eq!(best_draft_len(&costs, ALONE, 4, 0.9), None);
        costs.record(1, 0.010);
        // Rows not measured yet cost what one row costs: at any acceptance, try them.
        assert_eq!(best_draft_len(&costs, ALONE, 4, 0.5), Some(4));
        // Rows nearly free (weights-bound): drafts pay even at a low acceptance rate.
        for rows in 2..=5 {
            costs.record(rows, 0.010 + 0.0005 * (rows - 1) as f64);
        }
        assert_eq!(best_draft_len(&costs, ALONE, 4, 0.9), Some(4));
        // At 0.3 a third draft adds 0.027 expected tokens for 4.5% more time: two pay best.
        assert_eq!(best_draft_len(&costs, ALONE, 4, 0.3), Some(2));
        assert_eq!(best_draft_len(&costs, ALONE, 4, 0.0), Some(0));
        // Every row as dear as the first (arithmetic-bound): no rate below 1 pays.
        let mut dear = StepCosts::default();
        for rows in 1..=5 {
            dear.record(rows, 0.010 * rows as f64);
        }
        assert_eq!(best_draft_len(&dear, ALONE, 4, 0.95), Some(0));
        // Half as dear: pays once acceptance is high enough (1 + r >= 1.5 for one draft).
        let mut half = StepCosts::default();
        for rows in 1..=5 {
            half.record(rows, 0.010 * (1.0 + 0.5 * (rows - 1) as f64));
        }
        assert_eq!(best_draft_len(&half, ALONE, 4, 0.4), Some(0));
        assert_eq!(best_draft_len(&half, ALONE, 4, 0.6), Some(1));
        assert_eq!(best_draft_len(&half, ALONE, 4, 0.95), Some(4));
        // In a batch of 5 decode rows (5 tokens), one draft at 0.6 adds 0.6 tokens to the 5
        // for 50% more time: it pays for the sequence alone, not for the batch.
        for rows in 6..=9 {
            half.record(rows, 0.010 * (1.0 + 0.5 * (rows - 1) as f64));
        }
        let batch = StepSoFar {
            rows: 5,
            tokens: 5.0,
        };
        assert_eq!(best_draft_len(&half, batch, 4, 0.6), Some(0));
        // Nearly free rows pay in a batch too, at a high enough rate.
        let mut cheap = StepCosts::default();
        for rows in 5..=9 {
            cheap.record(rows, 0.010 + 0.0002 * (rows - 5) as f64);
        }
        assert_eq!(best_draft_len(&cheap, batch, 4, 0.9), Some(4));
        assert!((expected_accepted(3, 0.5) - 0.875).abs() < 1e-12);
        // The average follows new measurements.
        let mut c = StepCosts::default();
        c.record(3, 1.0);
        c.record(3, 2.0);
        assert_eq!(c.get(3), Some(1.2));
        assert_eq!(c.get(2), None);
    }

    #[test]
    fn the_acceptance_rate_follows_the_checked_drafts() {
        let mut d = DraftLength::new(4);
        assert_eq!(d.rate(), 0.5);
        for _ in 0..60 {
            // 2 accepted, the third rejected: 3 checked (the fourth never was).
            d.update(4, 2, 4);
        }
        assert!((d.rate() - 2.0 / 3.0).abs() < 1e-3, "{}", d.rate());
        for _ in 0..60 {
            d.update(4, 4, 4);
        }
        assert!(d.rate() > 0.99);
    }

    #[test]
    fn drafts_that_stay_rejected_are_given_up_and_half_right_ones_are_not() {
        let mut d = DraftLength::new(4);
        let (mut steps, mut checks) = (0, 0);
        while !d.stays_rejected() {
            let k = d.take();
            if k > 0 {
                d.update(k, 0, 4);
                checks += 1;
            }
            steps += 1;
        }
        // 4, 2 and 1 drafts rejected, then one draft after pauses of 4, 8 and 16 steps.
        assert_eq!((checks, steps), (6, 34));
        // Every other step's drafts all accepted, the others' all rejected: about half right.
        let mut d = DraftLength::new(4);
        for step in 0..1000 {
            let k = d.take();
            if k > 0 {
                d.update(k, if step % 2 == 0 { k } else { 0 }, 4);
            }
            assert!(!d.stays_rejected(), "step {step}: rate {}", d.rate());
        }
    }

    #[test]
    fn drafts_that_do_not_pay_are_probed_less_and_less_often() {
        let mut d = DraftLength::new(4);
        let probes: Vec<u32> = (1..=600).filter(|_| d.probe()).collect();
        assert_eq!(probes, [4, 12, 28, 60, 124, 252, 380, 508]);
        // Drafts chosen again: the waits start over.
        d.chosen();
        let next: Vec<bool> = (0..4).map(|_| d.probe()).collect();
        assert_eq!(next, [false, false, false, true]);
        // Probing changes neither the estimate nor the length without the adaptive policy.
        assert_eq!((d.rate(), d.take()), (0.5, 4));
    }

    #[test]
    fn draft_length_shrinks_pauses_and_recovers() {
        let mut d = DraftLength::new(4);
        assert_eq!(d.take(), 4);
        d.update(4, 4, 4);
        assert_eq!(d.take(), 4, "capped at the maximum");
        d.update(4, 2, 4);
        assert_eq!(d.take(), 3, "partly accepted: one past what was accepted");
        d.update(3, 0, 4);
        assert_eq!(d.take(), 1);
        d.update(1, 0, 4);
        // Paused for 4 steps, then one draft.
        assert_eq!([d.take(), d.take(), d.take(), d.take()], [0; 4]);
        assert_eq!(d.take(), 1);
        d.update(1, 0, 4);
        assert_eq!((0..8).map(|_| d.take()).sum::<usize>(), 0, "pause doubled");
        assert_eq!(d.take(), 1);
        d.update(1, 1, 4);
        assert_eq!(d.take(), 2, "accepted again: grows");
        d.update(0, 0, 4);
        assert_eq!(d.take(), 2, "nothing proposed: unchanged");
    }
}
