//! Reading counters out of the Prometheus text exposition format (what a relay's `/metrics` serves).
//! Only what the console needs: the sum of one counter over all its label sets. The text comes from
//! another process over the network, so nothing in it is trusted: comments, unknown metrics, broken
//! lines and absurd values are skipped, never a reason to fail the whole scrape, and the work is one
//! pass over the bytes (no allocation per line, so a huge line costs only its length).

/// One counter, summed over every label set it was exported with.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Sum {
    /// The sum of the accepted samples' values.
    pub total: f64,
    /// Samples accepted (finite, not negative).
    pub samples: usize,
    /// Samples of this counter that were skipped: a value that is not a number, is NaN, infinite or
    /// negative (no counter can be), or a line that cannot be read.
    pub rejected: usize,
}

impl Sum {
    /// The total as a whole count (counters count events); saturates instead of wrapping when a
    /// hostile endpoint sends 1e300.
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "saturating on purpose: `as` from f64 clamps to 0..=u64::MAX (and NaN to 0)"
    )]
    pub(crate) fn count(&self) -> u64 {
        // `as` from f64 saturates at the bounds; the total is never negative or NaN.
        self.total.round() as u64
    }
}

/// Sums each of `names` over its samples in `text` (the names are the samples' full names, e.g.
/// `waybill_relay_fenced_total`). `# HELP` / `# TYPE` lines, other metrics and lines that are not
/// samples are ignored.
pub(crate) fn sums<const N: usize>(text: &str, names: [&str; N]) -> [Sum; N] {
    let mut out = [Sum::default(); N];
    for line in text.split('\n') {
        let line = line.trim_matches(|c| c == ' ' || c == '\t' || c == '\r');
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(line.len());
        let Some(i) = names.iter().position(|n| *n == &line[..name_end]) else {
            continue;
        };
        match sample_value(&line[name_end..]) {
            Some(v) if v.is_finite() && v >= 0.0 => {
                out[i].total += v;
                out[i].samples += 1;
            }
            _ => out[i].rejected += 1,
        }
    }
    for sum in &mut out {
        // Many huge (finite) samples can still add up to infinity.
        if !sum.total.is_finite() {
            sum.total = f64::MAX;
        }
    }
    out
}

/// The value of a sample, given what follows its name: optional `{labels}`, whitespace, the value,
/// then (ignored) a timestamp or an OpenMetrics exemplar. `None` when the line cannot be read.
fn sample_value(rest: &str) -> Option<f64> {
    let rest = match rest.trim_start_matches([' ', '\t']).strip_prefix('{') {
        Some(labels) => &labels[labels_end(labels)?..],
        None => rest,
    };
    // The value must be separated from the name or labels (`foo_total1` is another name, and was
    // not matched; `foo_total}1` is garbage).
    let after = rest.trim_start_matches([' ', '\t']);
    if after.len() == rest.len() {
        return None;
    }
    let value = after.split([' ', '\t']).next()?;
    parse_value(value)
}

/// Where the label set ends (just past its `}`), skipping quoted values, which may hold `}`, `"`
/// (escaped), spaces and anything else.
fn labels_end(labels: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, b) in labels.bytes().enumerate() {
        match (quoted, escaped, b) {
            (true, true, _) => escaped = false,
            (true, false, b'\\') => escaped = true,
            (true, false, b'"') => quoted = false,
            (true, false, _) => {}
            (false, _, b'"') => quoted = true,
            (false, _, b'}') => return Some(i + 1),
            (false, _, _) => {}
        }
    }
    None
}

/// A sample value as the format writes it: a Go float (`1`, `1.5e3`, `NaN`, `+Inf`, `-Inf`).
fn parse_value(text: &str) -> Option<f64> {
    match text {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        // Rust also reads `inf`, `infinity` and `nan` in any case; those are not the format's, but
        // they are rejected later anyway as not finite.
        _ => text.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DUP: &str = "waybill_relay_duplicate_acks_total";
    const FENCED: &str = "waybill_relay_fenced_total";

    fn two(text: &str) -> [Sum; 2] {
        sums(text, [DUP, FENCED])
    }

    #[test]
    fn reads_what_the_relay_exports() {
        let text = "# HELP waybill_relay_duplicate_acks_total PubAcks with duplicate=true.\n\
                    # TYPE waybill_relay_duplicate_acks_total counter\n\
                    waybill_relay_duplicate_acks_total 7\n\
                    # HELP waybill_relay_fenced_total Publishes the broker's fence refused.\n\
                    # TYPE waybill_relay_fenced_total counter\n\
                    waybill_relay_fenced_total 2\n\
                    waybill_relay_published_total 1000\n";
        let [dup, fenced] = two(text);
        assert_eq!((dup.count(), dup.samples, dup.rejected), (7, 1, 0));
        assert_eq!((fenced.count(), fenced.samples, fenced.rejected), (2, 1, 0));
    }

    #[test]
    fn sums_over_label_sets_and_reads_exponents_and_timestamps() {
        let text = "waybill_relay_fenced_total{lane=\"0\"} 1e3\n\
                    waybill_relay_fenced_total{lane=\"1\",note=\"a } b \\\" c\"} 2.5E1 1700000000000\r\n\
                    \twaybill_relay_fenced_total { lane=\"2\" }   +3\n\
                    waybill_relay_fenced_total{} 4 # {trace_id=\"x\"} 1\n";
        let [dup, fenced] = two(text);
        assert_eq!(fenced.total, 1000.0 + 25.0 + 3.0 + 4.0);
        assert_eq!((fenced.samples, fenced.rejected), (4, 0));
        assert_eq!(dup, Sum::default(), "absent: nothing counted");
    }

    #[test]
    fn rejects_values_no_counter_can_have() {
        let text = "waybill_relay_fenced_total NaN\n\
                    waybill_relay_fenced_total{a=\"1\"} -5\n\
                    waybill_relay_fenced_total{a=\"2\"} +Inf\n\
                    waybill_relay_fenced_total{a=\"3\"} -Inf\n\
                    waybill_relay_fenced_total{a=\"4\"} infinity\n\
                    waybill_relay_fenced_total{a=\"5\"} twelve\n\
                    waybill_relay_fenced_total{a=\"6\"} 0x10\n\
                    waybill_relay_fenced_total{a=\"7\"}\n\
                    waybill_relay_fenced_total{a=\"8\" 9\n\
                    waybill_relay_fenced_total}1\n\
                    waybill_relay_fenced_total{a=\"9\"} 6\n";
        let [_, fenced] = two(text);
        assert_eq!(fenced.total, 6.0);
        assert_eq!((fenced.samples, fenced.rejected), (1, 10));
    }

    #[test]
    fn other_names_that_share_a_prefix_are_not_summed() {
        let text = "waybill_relay_fenced_total_extra 100\n\
                    waybill_relay_fenced_total1 100\n\
                    xwaybill_relay_fenced_total 100\n\
                    waybill_relay_fenced_created 1700000000\n\
                    waybill_relay_fenced_total 1\n";
        let [_, fenced] = two(text);
        assert_eq!((fenced.count(), fenced.samples, fenced.rejected), (1, 1, 0));
    }

    #[test]
    fn garbage_is_skipped() {
        let text = "\u{0}\u{1}\u{7f}<html><body>Not Found</body></html>\n{}{}{\n\"\"\"\n\
                    # waybill_relay_fenced_total 99\n   \n\n\r\n}\n\
                    💥 waybill_relay_fenced_total 5\n\
                    waybill_relay_fenced_total 5 💥\n";
        let [dup, fenced] = two(text);
        assert_eq!(dup, Sum::default());
        // The comment and the line that does not start with the name are not samples; the trailing
        // garbage after a value is ignored like a timestamp.
        assert_eq!((fenced.count(), fenced.samples, fenced.rejected), (5, 1, 0));
        assert_eq!(two(""), [Sum::default(); 2]);
    }

    #[test]
    fn huge_lines_and_huge_values_do_not_break_it() {
        let mut text = String::from("waybill_relay_fenced_total{a=\"");
        text.push_str(&"}\\\"".repeat(1_000_000));
        text.push_str("\"} 1\n");
        text.push_str(&"x".repeat(4_000_000));
        text.push_str("\nwaybill_relay_duplicate_acks_total{");
        text.push_str(&"a=\"b\",".repeat(200_000));
        text.push_str("} 2\n");
        let [dup, fenced] = two(&text);
        assert_eq!((fenced.count(), fenced.samples), (1, 1));
        assert_eq!((dup.count(), dup.samples), (2, 1));

        let text = "waybill_relay_fenced_total{a=\"1\"} 1e308\n\
                    waybill_relay_fenced_total{a=\"2\"} 1e308\n\
                    waybill_relay_fenced_total{a=\"3\"} 1e308\n\
                    waybill_relay_duplicate_acks_total 1e999\n";
        let [dup, fenced] = two(text);
        assert_eq!(fenced.count(), u64::MAX, "saturates");
        assert_eq!(
            (dup.samples, dup.rejected),
            (0, 1),
            "1e999 reads as infinity"
        );
    }
}
