//! Chat templates: a model's `chat_template` (from its `tokenizer_config.json`, or a file
//! given with `--chat-template`) rendered with minijinja, as HF transformers renders it
//! (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`, and
//! Python's string methods through minijinja-contrib's pycompat).

use super::error::ApiError;
use super::request::ChatMessage;
use serde::Serialize;
use std::path::Path;

/// Errors of reading a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
}

/// A chat template and the special tokens it may name.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

/// GPT-2's one special token, its BOS and EOS.
const END_OF_TEXT: &str = "<|endoftext|>";

#[derive(Serialize)]
struct Message<'a> {
    role: &'a str,
    content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
}

impl ChatTemplate {
    /// A template from its Jinja source, checked now (a syntax error is reported at start).
    pub fn new(source: impl Into<String>) -> Result<Self, String> {
        let template = Self {
            source: source.into(),
            bos_token: END_OF_TEXT.into(),
            eos_token: END_OF_TEXT.into(),
        };
        let env = template.environment();
        env.template_from_str(&template.source)
            .map_err(|e| format!("the chat template does not parse: {e}"))?;
        Ok(template)
    }

    /// A template file (`--chat-template FILE`): Jinja source.
    pub fn from_file(path: &Path) -> Result<Self, ChatTemplateError> {
        let source = std::fs::read_to_string(path).map_err(|source| ChatTemplateError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::new(source).map_err(|message| ChatTemplateError::Invalid {
            path: path.display().to_string(),
            message,
        })
    }

    /// The `chat_template` of a model folder's `tokenizer_config.json`, if it has one.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>, ChatTemplateError> {
        let path = dir.join("tokenizer_config.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(ChatTemplateError::Read {
                    path: path.display().to_string(),
                    source,
                })
            }
        };
        let invalid = |message: String| ChatTemplateError::Invalid {
            path: path.display().to_string(),
            message,
        };
        let config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        let Some(source) = config.get("chat_template").and_then(|t| t.as_str()) else {
            return Ok(None);
        };
        let mut template = Self::new(source).map_err(invalid)?;
        // a special token is a string or {"content": ...}
        let token = |name: &str| {
            let value = config.get(name)?;
            value
                .as_str()
                .or_else(|| value.get("content")?.as_str())
                .map(str::to_owned)
        };
        if let Some(bos) = token("bos_token") {
            template.bos_token = bos;
        }
        if let Some(eos) = token("eos_token") {
            template.eos_token = eos;
        }
        Ok(Some(template))
    }

    fn environment(&self) -> minijinja::Environment<'_> {
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    message,
                ))
            },
        );
        env
    }

    /// The prompt for `messages`, ending where the assistant's answer starts.
    pub(crate) fn render(&self, messages: &[ChatMessage]) -> Result<String, ApiError> {
        let messages = messages
            .iter()
            .map(|m| {
                Ok(Message {
                    role: &m.role,
                    content: content_text(m.content.as_ref())?,
                    name: m.name.as_deref(),
                })
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        if messages.is_empty() {
            return Err(ApiError::bad_request("`messages` is empty"));
        }
        let env = self.environment();
        let template = env
            .template_from_str(&self.source)
            .map_err(|e| ApiError::server_error(format!("the chat template: {e}")))?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| {
                ApiError::bad_request(format!("the chat template refused the messages: {e}"))
            })
    }
}

/// A message's text: a string, or the concatenated `text` parts of a list.
fn content_text(content: Option<&serde_json::Value>) -> Result<String, ApiError> {
    use serde_json::Value;
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(
                |part| match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(text))) => Ok(text.as_str()),
                    (kind, _) => Err(ApiError::bad_request(format!(
                        "message content parts must be text, got {}",
                        kind.unwrap_or("a part without a type")
                    ))),
                },
            )
            .collect::<Result<Vec<_>, _>>()
            .map(|parts| parts.concat()),
        Some(_) => Err(ApiError::bad_request(
            "message content must be a string or a list of text parts",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(role: &str, content: serde_json::Value) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: Some(content),
            name: None,
        }
    }

    #[test]
    fn renders_messages_with_python_methods_and_the_generation_prompt() {
        let template = ChatTemplate::new(
            "{% for m in messages %}{{ m.role | upper }}: {{ m.content.strip() }}\n{% endfor %}\
             {% if add_generation_prompt %}ASSISTANT:{% endif %}{{ eos_token if false }}",
        )
        .expect("parses");
        let prompt = template
            .render(&[
                message("user", serde_json::json!("  Hello  ")),
                message(
                    "assistant",
                    serde_json::json!([{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]),
                ),
            ])
            .expect("renders");
        assert_eq!(prompt, "USER: Hello\nASSISTANT: Hi!\nASSISTANT:");
    }

    #[test]
    fn a_model_folder_brings_its_template_and_special_tokens() {
        let dir = std::env::temp_dir().join(format!("chat-template-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        assert!(ChatTemplate::from_model_dir(&dir)
            .expect("no file")
            .is_none());
        let config = serde_json::json!({
            "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
            "bos_token": "<s>",
            "eos_token": { "content": "</s>", "lstrip": false },
        });
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("write");
        let template = ChatTemplate::from_model_dir(&dir)
            .expect("reads")
            .expect("has a template");
        let prompt = template
            .render(&[message("user", serde_json::json!("hi"))])
            .expect("renders");
        assert_eq!(prompt, "<s>hi</s>");
        std::fs::write(
            dir.join("tokenizer_config.json"),
            "{\"chat_template\": \"{% if %}\"}",
        )
        .expect("write");
        assert!(
            ChatTemplate::from_model_dir(&dir).is_err(),
            "a broken template fails at start"
        );
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn raise_exception_and_bad_parts_are_400s() {
        let template =
            ChatTemplate::new("{{ raise_exception('only user messages') }}").expect("parses");
        let e = template
            .render(&[message("user", serde_json::json!("x"))])
            .expect_err("refused");
        assert!(e.message.contains("only user messages"), "{}", e.message);
        let e = template
            .render(&[message("user", serde_json::json!([{"type": "image_url"}]))])
            .expect_err("refused");
        assert!(e.message.contains("image_url"));
        assert!(ChatTemplate::new("{% for %}").is_err());
    }
}
