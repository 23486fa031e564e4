//! One streamed `data:` chunk of a completion, read into the fields the client uses: the
//! first choice's text (borrowed from the line where it has no escapes) or the final chunk's
//! token count. On the machine it measures, the client's work per token takes cores from the
//! service, so the chunk is not built into a JSON tree.

use anyhow::{bail, Result};
use serde::de::IgnoredAny;
use serde::Deserialize;
use std::borrow::Cow;

/// What a chunk brings.
#[derive(Debug, PartialEq)]
pub enum Event<'a> {
    /// A piece of the text (not empty).
    Text(Cow<'a, str>),
    /// `usage.completion_tokens` of the chunk after the last (`stream_options.include_usage`).
    Usage(u64),
    /// Neither (an empty piece: a character or a stop string still open).
    Nothing,
}

#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(default)]
    error: Option<IgnoredAny>,
    #[serde(borrow, default)]
    choices: Option<Vec<Choice<'a>>>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    // (a `Cow` field of its own, not in an `Option`: serde borrows only then)
    #[serde(borrow, default)]
    text: Cow<'a, str>,
}

#[derive(Deserialize)]
struct Usage {
    completion_tokens: Option<u64>,
}

/// The chunk `data` (the line after `data: `); an error for the service's error chunk, or a
/// chunk without choices.
pub fn parse(data: &str) -> Result<Event<'_>> {
    let chunk: Chunk = serde_json::from_str(data)?;
    let (None, Some(choices)) = (chunk.error, chunk.choices) else {
        bail!("server error: {data}");
    };
    if let Some(n) = chunk.usage.and_then(|u| u.completion_tokens) {
        return Ok(Event::Usage(n));
    }
    let text = choices.into_iter().next().map(|c| c.text);
    Ok(match text.filter(|t| !t.is_empty()) {
        Some(text) => Event::Text(text),
        None => Event::Nothing,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_is_borrowed_unless_escaped() {
        let plain = r#"{"id":"c","object":"text_completion","choices":[{"index":0,"text":" the king","finish_reason":null}]}"#;
        assert!(matches!(
            parse(plain).expect("parses"),
            Event::Text(Cow::Borrowed(" the king"))
        ));
        let escaped = r#"{"choices":[{"text":"a\n\"b\"\u00e9"}]}"#;
        assert_eq!(
            parse(escaped).expect("parses"),
            Event::Text("a\n\"b\"\u{e9}".into())
        );
    }

    #[test]
    fn the_usage_chunk_gives_the_count_and_empty_pieces_nothing() {
        let usage = r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":128,"total_tokens":133}}"#;
        assert_eq!(parse(usage).expect("parses"), Event::Usage(128));
        assert_eq!(
            parse(r#"{"choices":[{"text":""}]}"#).expect("parses"),
            Event::Nothing
        );
        assert_eq!(
            parse(r#"{"choices":[],"usage":null}"#).expect("parses"),
            Event::Nothing
        );
    }

    #[test]
    fn errors_and_chunks_without_choices_fail() {
        let error = r#"{"error":{"message":"the model failed","type":"server_error"}}"#;
        assert!(parse(error)
            .expect_err("fails")
            .to_string()
            .contains("the model failed"));
        assert!(parse(r#"{"choices":null}"#).is_err());
        assert!(parse("not json").is_err());
    }
}
