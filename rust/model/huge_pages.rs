//! Weights on 2 MiB pages: the buffers the process owns (interleaved, quantized at load,
//! realigned) and the maps of the model files.
//!
//! A decode step reads every weight once, as a stream. On 4 KiB pages that stream needs a new
//! address translation every 4 KiB; on 2 MiB pages (transparent huge pages) the same read runs
//! faster (docs/benchmarks.md, "Huge pages"). Linux backs memory with huge pages where asked
//! (`madvise`, its usual setting), for 2 MiB-aligned stretches that are not backed yet, so the
//! advice goes on a fresh allocation before its first write. A file map's pages are the page
//! cache's: the advice asks for its reads to fill huge ones. It is advice: where the OS refuses
//! it (huge pages off, another OS) the memory is ordinary memory.

use memmap2::Mmap;

/// A zeroed `Vec<u32>` of `n` words whose whole 2 MiB pages are advised onto huge pages.
pub fn zeroed_words(n: usize) -> Vec<u32> {
    // A large zeroed allocation comes fresh from the OS (calloc does not write it), so none of
    // its pages are backed yet.
    let words = vec![0u32; n];
    advise(&words);
    words
}

/// Advises the whole 2 MiB pages inside `buf` onto huge pages; only pages not backed yet move.
pub fn advise<T>(buf: &[T]) {
    const HUGE: usize = 2 << 20;
    let (start, len) = (buf.as_ptr() as usize, std::mem::size_of_val(buf));
    let (first, end) = (start.next_multiple_of(HUGE), start + len);
    if end < first + HUGE {
        return;
    }
    let len = (end - first) / HUGE * HUGE;
    #[cfg(target_os = "linux")]
    // SAFETY: the range lies inside a live allocation of this process; the advice changes how
    // its pages are backed, not their contents. A refusal (EINVAL where huge pages are off) is
    // harmless: the pages stay 4 KiB.
    unsafe {
        libc::madvise(first as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = len;
}

/// Advises a model file's map onto huge pages (ignored where the OS refuses).
pub fn advise_map(map: &Mmap) {
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    #[cfg(not(target_os = "linux"))]
    let _ = map;
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// kB of anonymous huge pages in the mapping of this process that holds `addr`.
    fn anon_huge_kb_at(addr: usize) -> Option<usize> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let head = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = head.split_once('-') {
                if let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                {
                    inside = (lo..hi).contains(&addr);
                    continue;
                }
            }
            if inside {
                if let Some(kb) = line.strip_prefix("AnonHugePages:") {
                    return kb.trim().trim_end_matches("kB").trim().parse().ok();
                }
            }
        }
        None
    }

    #[test]
    fn owned_weights_land_on_huge_pages_where_the_os_offers_them() {
        let setting = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        if !setting.contains("[madvise]") && !setting.contains("[always]") {
            eprintln!("skipped: transparent huge pages are off here ({setting:?})");
            return;
        }
        let mut words = zeroed_words(8 << 18); // 8 MiB
        assert!(words.iter().all(|&w| w == 0));
        words
            .iter_mut()
            .enumerate()
            .for_each(|(i, w)| *w = i as u32);
        let kb = anon_huge_kb_at(words.as_ptr() as usize + (4 << 20)).expect("its mapping");
        // At least three of the four or five 2 MiB pages an 8 MiB buffer spans whole.
        assert!(
            kb >= 3 * 2048,
            "{kb} kB of huge pages under an 8 MiB weight buffer"
        );
        assert_eq!(words[(8 << 18) - 1], (8 << 18) - 1);
    }
}
