//! From token ids back to text, for streaming.
//!
//! GPT-2's byte-level BPE writes every byte as one printable character; [`TokenBytes`] undoes
//! that mapping for each vocabulary entry, so a token becomes its exact bytes. [`Utf8Stream`]
//! holds back an incomplete UTF-8 sequence until the bytes that finish it arrive, so a stream
//! never prints half a character. [`StopMatcher`] holds back text that could still become a
//! stop string.

use std::collections::HashMap;

/// GPT-2's reversible byte <-> printable-character table: printable Latin-1 bytes map to
/// themselves, the others to code points from 256 on, in byte order.
fn byte_to_char() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        table[b as usize] = if printable(b) {
            b as char
        } else {
            let c = char::from_u32(next).unwrap_or('\0');
            next += 1;
            c
        };
    }
    table
}

/// The bytes of every token id.
pub struct TokenBytes {
    bytes: Vec<Vec<u8>>,
}

impl TokenBytes {
    /// Build from the tokenizer's vocabulary (token string -> id). Special tokens such as
    /// `<|endoftext|>` are written out as their text.
    pub fn new(vocab: &HashMap<String, u32>, special: &[u32]) -> Self {
        let chars = byte_to_char();
        let char_to_byte: HashMap<char, u8> = chars
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        let size = vocab.values().map(|&i| i as usize + 1).max().unwrap_or(0);
        let mut bytes = vec![Vec::new(); size];
        for (token, &id) in vocab {
            bytes[id as usize] = if special.contains(&id) {
                token.as_bytes().to_vec()
            } else {
                token
                    .chars()
                    .map(|c| char_to_byte.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .unwrap_or_else(|| token.as_bytes().to_vec())
            };
        }
        Self { bytes }
    }

    pub fn get(&self, id: u32) -> &[u8] {
        self.bytes.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// All bytes of `ids`.
    pub fn concat(&self, ids: &[u32]) -> Vec<u8> {
        ids.iter()
            .flat_map(|&id| self.get(id).iter().copied())
            .collect()
    }
}

/// Turns a byte stream into text without ever splitting a character.
#[derive(Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Add bytes; return the text that is complete so far. Invalid bytes become U+FFFD
    /// (as a lossy decode would); an unfinished sequence at the end is held back.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    out.push_str(std::str::from_utf8(valid).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[bad..];
                        }
                        None => {
                            rest = after; // incomplete: wait for more bytes
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// Whatever is still held back, as lossy text (the stream ended mid-character).
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

/// Finds stop strings in generated text and tells how much text is safe to show.
pub struct StopMatcher {
    stops: Vec<String>,
    text: String,
    emitted: usize,
}

/// What [`StopMatcher::push`] found.
#[derive(Debug, PartialEq)]
pub enum StopState {
    /// Text that can be shown now.
    Continue(String),
    /// A stop string was found: the text before it that has not been shown yet.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            text: String::new(),
            emitted: 0,
        }
    }

    /// All text accepted so far (up to a stop string, once one is found).
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn push(&mut self, piece: &str) -> StopState {
        let search_from = self.emitted;
        self.text.push_str(piece);
        // The earliest stop string that ends in the new text.
        let found = self
            .stops
            .iter()
            .filter_map(|s| {
                // a stop may begin before the new piece, within text not yet emitted
                self.text[search_from..]
                    .find(s.as_str())
                    .map(|i| search_from + i)
            })
            .min();
        if let Some(at) = found {
            let out = self.text[self.emitted..at].to_owned();
            self.text.truncate(at);
            self.emitted = at;
            return StopState::Stopped(out);
        }
        // Hold back the longest suffix that is a prefix of some stop string.
        let hold = self
            .stops
            .iter()
            .map(|s| {
                (1..s.len())
                    .rev()
                    .find(|&n| s.is_char_boundary(n) && self.text.ends_with(&s[..n]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        let safe = (self.text.len() - hold).max(self.emitted);
        let out = self.text[self.emitted..safe].to_owned();
        self.emitted = safe;
        StopState::Continue(out)
    }

    /// The end of generation: release what was held back.
    pub fn finish(&mut self) -> String {
        let out = self.text[self.emitted..].to_owned();
        self.emitted = self.text.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_a_bijection() {
        let table = byte_to_char();
        let mut seen: Vec<char> = table.to_vec();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 256);
        assert_eq!(table[b' ' as usize], '\u{120}'); // the famous 'Ġ'
        assert_eq!(table[b'\n' as usize], '\u{10A}'); // 'Ċ'
        assert_eq!(table[b'a' as usize], 'a');
    }

    #[test]
    fn utf8_stream_holds_back_split_characters() {
        let mut s = Utf8Stream::default();
        let snowman = "☃".as_bytes(); // 3 bytes
        assert_eq!(s.push(b"a"), "a");
        assert_eq!(s.push(&snowman[..1]), "");
        assert_eq!(s.push(&snowman[1..2]), "");
        assert_eq!(s.push(&snowman[2..]), "☃");
        assert_eq!(s.push(&[0xFF, b'b']), "\u{FFFD}b");
        assert_eq!(s.push(&snowman[..2]), "");
        assert_eq!(s.finish(), "\u{FFFD}");
    }

    #[test]
    fn stop_strings_are_never_shown_even_across_pieces() {
        let mut m = StopMatcher::new(vec!["\n\n".into(), "END".into()]);
        assert_eq!(m.push("Hello E"), StopState::Continue("Hello ".into()));
        assert_eq!(m.push("N"), StopState::Continue("".into()));
        assert_eq!(m.push("X wor"), StopState::Continue("ENX wor".into()));
        assert_eq!(m.push("ld\n"), StopState::Continue("ld".into()));
        assert_eq!(m.push("\nmore"), StopState::Stopped("".into()));
        assert_eq!(m.text(), "Hello ENX world");
    }

    #[test]
    fn without_stops_everything_streams() {
        let mut m = StopMatcher::new(vec![]);
        assert_eq!(m.push("abc"), StopState::Continue("abc".into()));
        assert_eq!(m.finish(), "");
    }
}
