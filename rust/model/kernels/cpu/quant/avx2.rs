//! Placeholder (kernels to come): every type takes the scalar path.

use super::activation::Act;
use super::linear::{Out, QuantMatRef};

/// # Safety
/// As `linear::rows_dispatch`.
pub(super) unsafe fn rows(w: &QuantMatRef, r0: usize, r1: usize, act: &Act, out: Out) -> bool {
    let _ = (w, r0, r1, act, out);
    false
}
