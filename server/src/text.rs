//! One choice's text as it streams: bytes in, text out on UTF-8
//! boundaries, holding back the bytes a stop string could still claim.

/// A streamed choice's bytes and how much of them went out.
#[derive(Clone, Debug, Default)]
pub struct ChoiceText {
    bytes: Vec<u8>,
    /// Bytes already sent.
    sent: usize,
    /// Bytes held back while the choice runs: a stop string's length less
    /// one, since a match that starts there is not yet complete.
    hold: usize,
}

impl ChoiceText {
    /// A choice whose stop strings are at most `longest_stop` bytes long.
    pub fn new(longest_stop: usize) -> Self {
        Self {
            hold: longest_stop.saturating_sub(1),
            ..Self::default()
        }
    }

    /// Appends a token's bytes; returns the text that is now safe to send.
    pub fn push(&mut self, token: &[u8]) -> String {
        self.bytes.extend_from_slice(token);
        let end = self.bytes.len().saturating_sub(self.hold);
        self.take(end, false)
    }

    /// The choice ended with a token of these bytes: its answer is the
    /// first `answer_len` bytes (a stop string matched there) or all of
    /// them. Returns the rest to send.
    pub fn end(&mut self, token: &[u8], answer_len: Option<usize>) -> String {
        self.bytes.extend_from_slice(token);
        let end = answer_len.unwrap_or(self.bytes.len()).min(self.bytes.len());
        self.take(end, true)
    }

    /// Every byte so far.
    #[cfg(test)]
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Text from `sent` up to `end`, stopping before a UTF-8 sequence
    /// still incomplete unless `last`; invalid bytes become U+FFFD.
    fn take(&mut self, end: usize, last: bool) -> String {
        let mut out = String::new();
        while self.sent < end {
            match std::str::from_utf8(&self.bytes[self.sent..end]) {
                Ok(s) => {
                    out.push_str(s);
                    self.sent = end;
                }
                Err(e) => {
                    let ok = self.sent + e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.bytes[self.sent..ok]).unwrap_or(""));
                    self.sent = ok;
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{fffd}');
                            self.sent += n;
                        }
                        // Incomplete at `end`: wait for the next bytes, or
                        // at the end give up on them.
                        None if last => {
                            out.push('\u{fffd}');
                            self.sent = end;
                        }
                        None => break,
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_waits_for_whole_characters_and_for_stop_strings() {
        let mut c = ChoiceText::new(0);
        let snow = "☃".as_bytes();
        assert_eq!(c.push(b"a"), "a");
        assert_eq!(c.push(&snow[..1]), "", "half a character waits");
        assert_eq!(c.push(&snow[1..]), "☃");
        assert_eq!(
            c.push(&[0xff, b'b']),
            "\u{fffd}b",
            "invalid bytes are replaced"
        );
        assert_eq!(c.push(&snow[..2]), "");
        assert_eq!(c.end(b"", None), "\u{fffd}", "a cut character at the end");

        // A stop string of 3 bytes holds 2 back; the match is not sent.
        let mut c = ChoiceText::new(3);
        assert_eq!(c.push(b"hello"), "hel");
        assert_eq!(c.push(b" EN"), "lo ");
        assert_eq!(
            c.end(b"D", Some(6)),
            "",
            "END matched at 6: none of it goes out"
        );
        assert_eq!(c.bytes(), b"hello END");
        let mut c = ChoiceText::new(3);
        assert_eq!(c.push(b"ab"), "");
        assert_eq!(c.end(b"c", None), "abc");
    }
}
