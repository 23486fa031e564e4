//! The GPT-2 tokenizer: HF `tokenizers` byte-level BPE built from the original GPT-2
//! `vocab.json` and `merges.txt`, embedded in the module (or an HF `tokenizer.json` file).

use crate::text::TokenBytes;
use std::collections::HashMap;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::Tokenizer;

const VOCAB_JSON: &str = include_str!("../assets/vocab.json");
const MERGES_TXT: &str = include_str!("../assets/merges.txt");

/// GPT-2's `<|endoftext|>`.
pub const END_OF_TEXT: u32 = 50256;

pub struct Gpt2Tokenizer {
    tokenizer: Tokenizer,
    bytes: TokenBytes,
    end_of_text: Option<u32>,
    /// `tokenizer.get_vocab_size(true)`, counted once: HF computes it by building the whole
    /// vocabulary map (about 10 ms in the guest each time).
    vocab_size: usize,
}

pub type Error = Box<dyn std::error::Error + Send + Sync>;

impl Gpt2Tokenizer {
    /// The embedded GPT-2 vocabulary.
    pub fn embedded() -> Result<Self, Error> {
        let vocab_map: HashMap<String, u32> = serde_json::from_str(VOCAB_JSON)?;
        let merges: Merges = MERGES_TXT
            .lines()
            .filter(|l| !l.starts_with("#version") && !l.is_empty())
            .map(|l| {
                l.split_once(' ')
                    .map(|(a, b)| (a.to_owned(), b.to_owned()))
                    .ok_or_else(|| format!("bad merge line `{l}`"))
            })
            .collect::<Result<_, _>>()?;
        let vocab: Vocab = vocab_map.iter().map(|(k, v)| (k.clone(), *v)).collect();
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build()?;
        let mut tokenizer = Tokenizer::new(bpe);
        tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
        Ok(Self::from_parts(tokenizer, vocab_map))
    }

    /// An HF `tokenizer.json` (byte-level BPE).
    pub fn from_json(bytes: &[u8]) -> Result<Self, Error> {
        let tokenizer = Tokenizer::from_bytes(bytes)?;
        let vocab_map: HashMap<String, u32> = tokenizer.get_vocab(true).into_iter().collect();
        Ok(Self::from_parts(tokenizer, vocab_map))
    }

    fn from_parts(tokenizer: Tokenizer, vocab: HashMap<String, u32>) -> Self {
        let end_of_text = vocab.get("<|endoftext|>").copied();
        let special: Vec<u32> = end_of_text.into_iter().collect();
        Self {
            bytes: TokenBytes::new(&vocab, &special),
            // the same count as `tokenizer.get_vocab_size(true)`: `vocab` is the vocabulary
            // with the added tokens (`get_vocab(true)`, or the BPE vocabulary alone when
            // nothing was added)
            vocab_size: vocab.len(),
            tokenizer,
            end_of_text,
        }
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>, Error> {
        Ok(self.tokenizer.encode(text, false)?.get_ids().to_vec())
    }

    /// Full decode (lossy on broken UTF-8), the same as HF's `decode`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, Error> {
        self.tokenizer.decode(ids, false)
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn end_of_text(&self) -> Option<u32> {
        self.end_of_text
    }

    /// The exact bytes of each token, for streaming.
    pub fn token_bytes(&self) -> &TokenBytes {
        &self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_tokenizer_round_trips_and_knows_gpt2_ids() {
        let tok = Gpt2Tokenizer::embedded().expect("embedded tokenizer");
        assert_eq!(tok.vocab_size(), 50257);
        assert_eq!(tok.vocab_size(), tok.tokenizer.get_vocab_size(true));
        assert_eq!(tok.end_of_text(), Some(END_OF_TEXT));
        // Well-known GPT-2 ids: "Hello" = 15496, " world" = 995.
        assert_eq!(tok.encode("Hello world").expect("encode"), vec![15496, 995]);
        let text = "ROMEO:\nBut, soft! what light through yonder window breaks? ☃ café";
        let ids = tok.encode(text).expect("encode");
        assert_eq!(tok.decode(&ids).expect("decode"), text);
        assert_eq!(
            String::from_utf8(tok.token_bytes().concat(&ids)).expect("utf8"),
            text
        );
    }
}
