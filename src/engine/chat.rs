//! Chat prompts as the checkpoint's own chat template renders them: `tokenizer_config.json`'s
//! `chat_template`, a Jinja template, rendered with minijinja (as Hugging Face's tokenizers
//! render it in Python, with the same variables: `messages`, `add_generation_prompt`,
//! `bos_token`, `eos_token`, and Python's string methods). A checkpoint without one (spex's own
//! models) gets ChatML, the format Ouro's chat models were trained on. Used by
//! `tokenizer::TextTokenizer`, which the CLI and the dashboard ask for a chat prompt.

use std::path::Path;

use minijinja::{Environment, Error as JinjaError, ErrorKind, context};

use super::error::{EngineError, Result};

/// ChatML: each message as `<|im_start|>{role}\n{content}<|im_end|>\n`, then the assistant's
/// turn begun.
pub const CHATML: &str = "{% for message in messages %}<|im_start|>{{ message.role }}\n\
    {{ message.content }}<|im_end|>\n{% endfor %}\
    {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// A chat template, checked to compile and to render a user turn when it was read.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

impl Default for ChatTemplate {
    fn default() -> Self {
        Self {
            source: CHATML.to_string(),
            bos_token: String::new(),
            eos_token: String::new(),
        }
    }
}

impl ChatTemplate {
    /// The template of the checkpoint in `dir`: its `tokenizer_config.json`'s `chat_template`
    /// (a string, or the entry named "default" of a list of named templates), else ChatML.
    /// A config that cannot be read, or a template that does not compile or render, is an
    /// error naming the file and the field.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer_config.json");
        if !path.exists() {
            return Ok(Self::default());
        }
        let text =
            crate::engine::files::read_text(&path, crate::engine::files::FileKind::Settings)?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| EngineError::file(&path, format!("not valid JSON: {e}")))?;
        let field = |message: String| EngineError::Config {
            path: path.clone(),
            field: "chat_template".into(),
            message,
        };
        let source = match json.get("chat_template") {
            None | Some(serde_json::Value::Null) => return Ok(Self::default()),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(named)) => (named.iter())
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str())
                .ok_or_else(|| field("a list without a template named \"default\"".into()))?
                .to_string(),
            Some(_) => {
                return Err(field(
                    "neither a string nor a list of named templates".into(),
                ));
            }
        };
        let token = |key: &str| match json.get(key) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(v) => v
                .get("content")
                .and_then(|c| c.as_str())
                .unwrap_or("")
                .to_string(),
            None => String::new(),
        };
        let template = Self {
            source,
            bos_token: token("bos_token"),
            eos_token: token("eos_token"),
        };
        template.render("hello").map_err(|e| field(e.to_string()))?;
        Ok(template)
    }

    /// A template from its source, with no BOS or EOS text (tests, and callers with their own).
    pub fn from_source(source: &str) -> Result<Self> {
        let template = Self {
            source: source.to_string(),
            ..Self::default()
        };
        template.render("hello")?;
        Ok(template)
    }

    /// The prompt for one user turn `user`, the assistant's turn begun.
    pub fn render(&self, user: &str) -> Result<String> {
        let mut env = Environment::new();
        // Hugging Face renders with both on: a block tag's own line leaves no whitespace.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        let template = (env.template_from_str(&self.source))
            .map_err(|e| EngineError::Invalid(format!("chat template: {e}")))?;
        let messages = [context! { role => "user", content => user }];
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| EngineError::Invalid(format!("chat template: {e}")))
    }
}

/// Hugging Face's `raise_exception(message)`, which templates call on input they refuse.
fn raise_exception(message: String) -> std::result::Result<String, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
    }

    #[test]
    fn a_checkpoint_without_a_template_gets_chatml() {
        let dir = tempfile::TempDir::new().expect("temp dir");
        let chat = ChatTemplate::load(dir.path()).expect("no config is ChatML");
        assert_eq!(
            chat.render("Hi there").expect("render"),
            "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    /// The fixture is a Hugging Face tokenizer_config.json with a ChatML template of the
    /// hub's kind (a default system turn, Python's `.strip()`, `| trim`, `raise_exception`,
    /// block tags on lines of their own); the expected text is what Python's jinja2 renders
    /// with Hugging Face's settings.
    #[test]
    fn the_checkpoints_template_renders_as_hugging_face_renders_it() {
        let chat = ChatTemplate::load(&fixture()).expect("the fixture's template");
        assert_eq!(
            chat.render("  What is 2+2? ").expect("render"),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
             <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
        );
    }

    #[test]
    fn a_list_of_named_templates_uses_the_default_one() {
        let dir = tempfile::TempDir::new().expect("temp dir");
        let config = serde_json::json!({
            "eos_token": "<|im_end|>",
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "[{{ messages[0].content }}]{{ eos_token }}"},
            ],
        });
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let chat = ChatTemplate::load(dir.path()).expect("the default template");
        assert_eq!(chat.render("x").unwrap(), "[x]<|im_end|>");
    }

    #[test]
    fn a_template_that_does_not_compile_names_the_file_and_field() {
        let dir = tempfile::TempDir::new().expect("temp dir");
        let path = dir.path().join("tokenizer_config.json");
        std::fs::write(&path, r#"{"chat_template": "{% for m in messages %}"}"#).unwrap();
        let message = ChatTemplate::load(dir.path()).unwrap_err().to_string();
        assert!(message.contains("tokenizer_config.json"), "{message}");
        assert!(message.contains("chat_template"), "{message}");
        assert_eq!(message.lines().count(), 1, "{message}");
        let refused = ChatTemplate::from_source("{{ raise_exception('no users here') }}");
        assert!(refused.unwrap_err().to_string().contains("no users here"));
    }
}
