//! Stop strings over streamed text.
//!
//! The result never depends on how the text was split into pushes: a stop string ends the output
//! at the earliest position where one starts in the whole text. So a stop that completes while an
//! earlier-starting, longer stop is still possible waits until that one completes or fails (stops
//! "abcd" and "bc": after "abc" nothing is decided; "abcd" ends the output at "", "abcx" at "a").
//! When several stops start at the same earliest position the output is the same whichever is
//! taken (everything from that position on is dropped), so no further tie-break is needed.

/// Finds stop strings in streamed text, holding back any tail that could still begin one.
#[derive(Clone, Debug)]
pub struct StopStrings {
    /// Non-empty stop strings.
    stops: Vec<String>,
    /// Text received but not yet emitted. It begins where a stop string may still start.
    pending: String,
    stopped: bool,
}

impl StopStrings {
    /// Empty strings are ignored.
    pub fn new(stops: Vec<String>) -> StopStrings {
        StopStrings {
            stops: stops.into_iter().filter(|stop| !stop.is_empty()).collect(),
            pending: String::new(),
            stopped: false,
        }
    }

    /// Feeds newly decoded text. Returns the text that is now safe to emit and whether a stop
    /// string was found. On a match, the text before the earliest match is emitted, the stop string
    /// and anything after it never are, and every later call returns ("", true).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        if self.stops.is_empty() {
            return (text.to_owned(), false);
        }
        self.pending.push_str(text);
        let partial = self.partial_start();
        if let Some(start) = self.earliest_match() {
            // No stop can still begin before `start`, so this match is the earliest for good.
            if start <= partial {
                return (self.stop_at(start), true);
            }
        }
        let held = self.pending.split_off(partial);
        (std::mem::replace(&mut self.pending, held), false)
    }

    /// Generation ended for another reason: returns the held-back text.
    ///
    /// If the held text contains a complete stop string (kept waiting for a longer stop that
    /// started earlier and now never will complete), only the text before it is returned and
    /// [`StopStrings::stopped`] turns true.
    pub fn flush(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        match self.earliest_match() {
            Some(start) => self.stop_at(start),
            None => std::mem::take(&mut self.pending),
        }
    }

    /// Whether a stop string has been found (by `push`, or by `flush` as described there).
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    fn stop_at(&mut self, start: usize) -> String {
        self.stopped = true;
        self.pending.truncate(start);
        std::mem::take(&mut self.pending)
    }

    /// Byte offset of the earliest complete stop string in `pending`.
    fn earliest_match(&self) -> Option<usize> {
        self.stops
            .iter()
            .filter_map(|stop| self.pending.find(stop.as_str()))
            .min()
    }

    /// Byte offset of the longest suffix of `pending` that is a proper prefix of some stop string;
    /// `pending.len()` if there is none. Always a char boundary.
    fn partial_start(&self) -> usize {
        let text = self.pending.as_bytes();
        let mut start = text.len();
        for stop in &self.stops {
            let stop = stop.as_bytes();
            let longest = (stop.len() - 1).min(text.len());
            for len in (1..=longest).rev() {
                let at = text.len() - len;
                if at >= start {
                    break;
                }
                // A byte match starting mid-character is impossible for valid UTF-8, but the
                // boundary check keeps the split below safe regardless.
                if self.pending.is_char_boundary(at) && text[at..] == stop[..len] {
                    start = at;
                    break;
                }
            }
        }
        start
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(list: &[&str]) -> StopStrings {
        StopStrings::new(list.iter().map(|s| s.to_string()).collect())
    }

    /// Feeds `pieces` in order, then flushes; returns the concatenated output and the decision.
    fn feed(list: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut matcher = stops(list);
        let mut out = String::new();
        for piece in pieces {
            let (emitted, _) = matcher.push(piece);
            out.push_str(&emitted);
        }
        out.push_str(&matcher.flush());
        (out, matcher.stopped())
    }

    /// What the whole text should give: everything before the earliest stop.
    fn oracle(list: &[&str], text: &str) -> (String, bool) {
        let earliest = list
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| text.find(s))
            .min();
        match earliest {
            Some(start) => (text[..start].to_string(), true),
            None => (text.to_string(), false),
        }
    }

    #[test]
    fn no_stops_passes_text_through_at_once() {
        let mut matcher = stops(&[]);
        assert_eq!(
            matcher.push("hello \n\n"),
            ("hello \n\n".to_string(), false)
        );
        assert_eq!(matcher.push("wörld"), ("wörld".to_string(), false));
        assert_eq!(matcher.flush(), "");
        assert!(!matcher.stopped());
    }

    #[test]
    fn empty_stop_strings_are_ignored() {
        let mut matcher = stops(&["", ""]);
        assert_eq!(matcher.push("abc"), ("abc".to_string(), false));
        let mut matcher = stops(&["", "c"]);
        assert_eq!(matcher.push("abcd"), ("ab".to_string(), true));
    }

    #[test]
    fn match_within_one_push_drops_stop_and_rest() {
        let mut matcher = stops(&["END"]);
        assert_eq!(matcher.push("abcENDxyz"), ("abc".to_string(), true));
        assert_eq!(matcher.push("more"), (String::new(), true));
        assert_eq!(matcher.push(""), (String::new(), true));
        assert_eq!(matcher.flush(), "");
        assert!(matcher.stopped());
    }

    #[test]
    fn match_across_push_boundary() {
        let mut matcher = stops(&["\n\n"]);
        assert_eq!(matcher.push("a\n"), ("a".to_string(), false));
        assert_eq!(matcher.push("\nb"), (String::new(), true));
        assert_eq!(matcher.push("c"), (String::new(), true));
    }

    #[test]
    fn stop_split_into_single_characters() {
        let mut matcher = stops(&["STOP"]);
        assert_eq!(matcher.push("xS"), ("x".to_string(), false));
        assert_eq!(matcher.push("T"), (String::new(), false));
        assert_eq!(matcher.push("O"), (String::new(), false));
        assert_eq!(matcher.push("P"), (String::new(), true));
        assert_eq!(matcher.push("tail"), (String::new(), true));
    }

    #[test]
    fn false_alarm_releases_held_text() {
        let mut matcher = stops(&["\n\n"]);
        assert_eq!(matcher.push("a\n"), ("a".to_string(), false));
        assert_eq!(matcher.push("b"), ("\nb".to_string(), false));
        let mut matcher = stops(&["STOP"]);
        assert_eq!(matcher.push("STO"), (String::new(), false));
        assert_eq!(matcher.push("NE"), ("STONE".to_string(), false));
    }

    #[test]
    fn holds_back_only_the_longest_suffix_that_can_start_a_stop() {
        let mut matcher = stops(&["abcd"]);
        assert_eq!(matcher.push("zab"), ("z".to_string(), false));
        // "abcab": only the final "ab" can still become "abcd".
        assert_eq!(matcher.push("cab"), ("abc".to_string(), false));
        assert_eq!(matcher.push("cd"), (String::new(), true));

        // The longest held suffix across stops: "xy" (of "xyz") beats "y" (of "yq").
        let mut matcher = stops(&["yq", "xyz"]);
        assert_eq!(matcher.push("12xy"), ("12".to_string(), false));
        assert_eq!(matcher.push("q"), ("x".to_string(), true));
    }

    #[test]
    fn flush_returns_held_text() {
        let mut matcher = stops(&["abcd"]);
        assert_eq!(matcher.push("xab"), ("x".to_string(), false));
        assert_eq!(matcher.flush(), "ab");
        assert!(!matcher.stopped());
    }

    #[test]
    fn multibyte_characters_are_never_split() {
        let mut matcher = stops(&["日本語"]);
        assert_eq!(matcher.push("今日は日本"), ("今日は".to_string(), false));
        assert_eq!(matcher.push("人"), ("日本人".to_string(), false));
        assert_eq!(matcher.push("日"), (String::new(), false));
        assert_eq!(matcher.push("本語です"), (String::new(), true));

        // "é" (C3 A9) and "ê" (C3 AA) share a first byte but are different characters.
        let mut matcher = stops(&["é"]);
        assert_eq!(matcher.push("ê"), ("ê".to_string(), false));
        assert_eq!(matcher.push("aé"), ("a".to_string(), true));

        assert_eq!(
            feed(&["€5"], &["price ", "€", "€", "5 each"]),
            ("price €".to_string(), true)
        );
        assert_eq!(
            feed(&["🙂!"], &["ok 🙂", "🙂", "?", "🙂"]),
            ("ok 🙂🙂?🙂".to_string(), false)
        );
    }

    #[test]
    fn earliest_match_start_wins_over_list_order() {
        // "abc" starts at 1, "bcd" at 2.
        assert_eq!(feed(&["abc", "bcd"], &["xabcd"]), ("x".to_string(), true));
        assert_eq!(feed(&["bcd", "abc"], &["xabcd"]), ("x".to_string(), true));
        assert_eq!(
            feed(&["bcd", "abc"], &["x", "a", "b", "c", "d"]),
            ("x".to_string(), true)
        );
        // The later-listed stop starts earlier.
        assert_eq!(feed(&["d", "ab"], &["xabcd"]), ("x".to_string(), true));
    }

    #[test]
    fn stop_that_is_a_prefix_of_another_stops_at_once() {
        let mut matcher = stops(&["abc", "ab"]);
        assert_eq!(matcher.push("xa"), ("x".to_string(), false));
        // "ab" is complete and nothing can start earlier: no need to wait for a possible "c".
        assert_eq!(matcher.push("b"), (String::new(), true));
        assert_eq!(feed(&["ab", "abc"], &["xabc"]), ("x".to_string(), true));
    }

    #[test]
    fn stop_inside_a_longer_stop_waits_for_the_earlier_one() {
        // "bc" completes first but "abcd" may still start earlier, at 0.
        let mut matcher = stops(&["abcd", "bc"]);
        assert_eq!(matcher.push("abc"), (String::new(), false));
        assert!(!matcher.stopped());
        assert_eq!(matcher.push("d"), (String::new(), true));

        let mut matcher = stops(&["abcd", "bc"]);
        assert_eq!(matcher.push("abc"), (String::new(), false));
        assert_eq!(matcher.push("x"), ("a".to_string(), true));

        // Generation ends while waiting: the held "bc" match stands.
        let mut matcher = stops(&["abcd", "bc"]);
        assert_eq!(matcher.push("zabc"), ("z".to_string(), false));
        assert_eq!(matcher.flush(), "a");
        assert!(matcher.stopped());
        assert_eq!(matcher.push("more"), (String::new(), true));
    }

    #[test]
    fn random_splits_match_feeding_whole() {
        let cases: &[(&[&str], &str)] = &[
            (&["\n\n"], "line one\nline two\n\nnext"),
            (&["abc", "bcd"], "xxabxabcd tail"),
            (&["abcd", "bc"], "aab abcx abcd"),
            (&["abcd", "bc"], "aab abcd bc"),
            (&["ab", "abc", "b!"], "a ab!c"),
            (&["日本語", "本"], "今日は日本人、日本語です"),
            (&["</s>", "s"], "<ok> </t> </"),
            (&["</s>", "s>"], "<ok> </t> </s"),
            (&["aaab"], "aaaaaaaaaaaab"),
            (&["ééx", "🙂🙂"], "éé éééx 🙂"),
            (&["zz"], "no stop in here at all, é 🙂"),
        ];
        let mut rng = crate::rng::Rng(42);
        for &(list, text) in cases {
            let whole = feed(list, &[text]);
            assert_eq!(whole, oracle(list, text), "{list:?} on {text:?}");
            let boundaries: Vec<usize> = (1..text.len())
                .filter(|&i| text.is_char_boundary(i))
                .collect();
            for _ in 0..1000 {
                let mut cuts: Vec<usize> = boundaries
                    .iter()
                    .copied()
                    .filter(|_| rng.next_u().is_multiple_of(3))
                    .collect();
                cuts.insert(0, 0);
                cuts.push(text.len());
                let pieces: Vec<&str> = cuts.windows(2).map(|w| &text[w[0]..w[1]]).collect();
                assert_eq!(feed(list, &pieces), whole, "{list:?} on {pieces:?}");
            }
        }
        // Exact expectations for a few of the cases above.
        assert_eq!(
            oracle(&["abcd", "bc"], "aab abcx abcd"),
            ("aab a".to_string(), true)
        );
        assert_eq!(
            oracle(&["</s>", "s"], "<ok> </t> </"),
            ("<ok> </t> </".to_string(), false)
        );
        assert_eq!(
            oracle(&["日本語", "本"], "今日は日本人、日本語です"),
            ("今日は日".to_string(), true)
        );
    }
}
