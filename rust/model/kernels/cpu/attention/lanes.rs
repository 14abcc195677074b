//! The scalar side shared by the lanes paths (query lanes in vector lanes, for blocks of rows):
//! each lane's state in a key tile and the runs of lanes that see the same keys.

use super::*;

/// The scalar side of one vector of query lanes in a key tile, shared by the lanes paths
/// ([`lanes_step_avx512`], [`lanes_step_avx2`]; `QL` lanes a vector): each lane's (row, head),
/// the keys of the tile it sees, its running max and sum before the tile, and afterwards its new
/// state and the runs of lanes that see the same keys.
pub(super) struct LaneTile<const QL: usize> {
    count: usize,
    /// Each lane's (row, head), counted up from the first: no division per lane.
    rh: [(usize, usize); QL],
    /// Each lane's visible keys in this tile, `ka..=kb` (none: ka > kb).
    pub(super) ka: [i32; QL],
    pub(super) kb: [i32; QL],
    pub(super) mx: [f32; QL],
    pub(super) sum: [f32; QL],
}

impl<const QL: usize> LaneTile<QL> {
    /// Lanes `base..base + count` of `parts.len() * group`, in the tile of keys from `t0`.
    #[inline(always)]
    pub(super) fn new(
        parts: &[(usize, usize)],
        t0: usize,
        group: usize,
        base: usize,
        count: usize,
        states: &[State],
    ) -> Self {
        let mut lt = LaneTile {
            count,
            rh: [(0, 0); QL],
            ka: [LANES as i32; QL],
            kb: [0; QL],
            mx: [f32::NEG_INFINITY; QL],
            sum: [0.0; QL],
        };
        let (mut i, mut h) = (base / group, base % group);
        for l in 0..count {
            lt.rh[l] = (i, h);
            let (a, b) = (parts[i].0.max(t0), parts[i].1.min(t0 + LANES - 1));
            if a <= b {
                (lt.ka[l], lt.kb[l]) = ((a - t0) as i32, (b - t0) as i32);
            }
            lt.mx[l] = states[i].mx[h];
            lt.sum[l] = states[i].sum[h];
            h += 1;
            if h == group {
                (i, h) = (i + 1, 0);
            }
        }
        lt
    }

    #[inline(always)]
    fn sees_keys(&self, l: usize) -> bool {
        self.ka[l] <= self.kb[l]
    }

    /// Stores each lane's new max and sum (lanes with no key in the tile are left as they are)
    /// and returns where each such lane's accumulator starts (null for the others).
    #[inline(always)]
    pub(super) fn store_states(
        &self,
        new_max: &[f32; QL],
        new_sum: &[f32; QL],
        accs: &mut [&mut [f32]],
        states: &mut [State],
        hd: usize,
    ) -> [*mut f32; QL] {
        let mut acc_at = [std::ptr::null_mut::<f32>(); QL];
        for l in (0..self.count).filter(|&l| self.sees_keys(l)) {
            let (i, h) = self.rh[l];
            states[i].mx[h] = new_max[l];
            states[i].sum[h] = new_sum[l];
            acc_at[l] = accs[i][h * hd..(h + 1) * hd].as_mut_ptr();
        }
        acc_at
    }

    /// The runs `l..e` of at most `max_run` consecutive lanes that see the same keys, in lane
    /// order (lanes that see none are skipped). An iterator, not a callback: a closure would not
    /// inherit its caller's target features, and the intrinsics in it would become calls.
    #[inline(always)]
    pub(super) fn same_key_runs(&self, max_run: usize) -> SameKeyRuns<'_, QL> {
        SameKeyRuns {
            tile: self,
            max_run,
            l: 0,
        }
    }
}

pub(super) struct SameKeyRuns<'a, const QL: usize> {
    tile: &'a LaneTile<QL>,
    max_run: usize,
    l: usize,
}

impl<const QL: usize> Iterator for SameKeyRuns<'_, QL> {
    type Item = (usize, usize);

    #[inline(always)]
    fn next(&mut self) -> Option<(usize, usize)> {
        let t = self.tile;
        while self.l < t.count && !t.sees_keys(self.l) {
            self.l += 1;
        }
        let l = self.l;
        if l >= t.count {
            return None;
        }
        let mut e = l + 1;
        while e < t.count && e - l < self.max_run && t.ka[e] == t.ka[l] && t.kb[e] == t.kb[l] {
            e += 1;
        }
        self.l = e;
        Some((l, e))
    }
}
