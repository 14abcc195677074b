//! Weights on 2 MiB pages: the bytes the process owns (interleaved, quantized at load,
//! realigned: [`OwnedBytes`]) and the maps of the model files.
//!
//! A decode step reads every weight once, as a stream. On 4 KiB pages that stream needs a new
//! address translation every 4 KiB; on 2 MiB pages (transparent huge pages) the same read runs
//! faster (docs/benchmarks.md, "Huge pages"). Linux backs memory with huge pages where asked
//! (`madvise`, its usual setting), for 2 MiB-aligned stretches that are not backed yet, so the
//! advice goes on fresh memory before its first write. A file map's pages are the page
//! cache's: the advice asks for its reads to fill huge ones. It is advice: where the OS refuses
//! it (huge pages off, another OS) the memory is ordinary memory.

use memmap2::{Mmap, MmapMut};

const HUGE: usize = 2 << 20;

/// Zeroed bytes the process owns (a weight matrix it rewrote), on 2 MiB pages where the OS
/// gives them. From 2 MiB up they are an anonymous map of their own, started at a 2 MiB
/// boundary and advised before the first write: a heap allocation of that size may reuse
/// pages the process already touched (the allocator serves mid-sized blocks from its heaps
/// once big ones were freed), and touched pages stay 4 KiB. Smaller ones, or where the map is
/// refused, are a heap allocation.
pub struct OwnedBytes {
    storage: Storage,
    /// Where the bytes start in the storage (the map's first 2 MiB boundary).
    start: usize,
    len: usize,
}

enum Storage {
    Map(MmapMut),
    /// Words, so that the bytes are 4-aligned for f32 tensors.
    Heap(Vec<u32>),
}

impl OwnedBytes {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> OwnedBytes {
        if len >= HUGE {
            // The slack before the boundary is never touched, so it costs address space only.
            if let Ok(map) = MmapMut::map_anon(len + HUGE) {
                let addr = map.as_ptr() as usize;
                let start = addr.next_multiple_of(HUGE) - addr;
                let bytes = OwnedBytes {
                    storage: Storage::Map(map),
                    start,
                    len,
                };
                advise(bytes.bytes());
                return bytes;
            }
        }
        OwnedBytes {
            storage: Storage::Heap(vec![0u32; len.div_ceil(4)]),
            start: 0,
            len,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Map(map) => &map[self.start..self.start + self.len],
            // SAFETY: the vector holds len.div_ceil(4) initialised words, at least `len` bytes.
            Storage::Heap(words) => unsafe {
                std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), self.len)
            },
        }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.storage {
            Storage::Map(map) => &mut map[self.start..self.start + self.len],
            // SAFETY: as in `bytes`, and any byte pattern is a valid u32.
            Storage::Heap(words) => unsafe {
                std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), self.len)
            },
        }
    }

    /// Whether the bytes are a map of their own (else a heap allocation).
    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Map(_))
    }
}

/// Advises the whole 2 MiB pages inside `buf` onto huge pages; only pages not backed yet move.
fn advise<T>(buf: &[T]) {
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
        // Freed heap blocks first, as a loaded engine has: the allocator then serves
        // mid-sized blocks from pages it already touched.
        for _ in 0..4 {
            std::hint::black_box(vec![1u8; 16 << 20]);
        }
        let mut owned = OwnedBytes::zeroed(8 << 20);
        assert!(owned.is_mapped());
        assert!(owned.bytes().iter().all(|&b| b == 0));
        assert_eq!(owned.bytes().as_ptr() as usize % HUGE, 0);
        owned
            .bytes_mut()
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = i as u8);
        let kb = anon_huge_kb_at(owned.bytes().as_ptr() as usize).expect("its mapping");
        // At least three of the four 2 MiB pages (one may be refused under memory pressure).
        assert!(
            kb >= 3 * 2048,
            "{kb} kB of huge pages under an 8 MiB weight buffer"
        );
        assert_eq!(owned.bytes()[(8 << 20) - 1], ((8 << 20) - 1) as u8);
        // Below 2 MiB: the heap, 4-aligned, zeroed.
        let small = OwnedBytes::zeroed(1000);
        assert!(!small.is_mapped());
        assert_eq!(
            (small.bytes().len(), small.bytes().as_ptr() as usize % 4),
            (1000, 0)
        );
        assert!(small.bytes().iter().all(|&b| b == 0));
    }
}
