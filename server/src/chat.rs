//! Chat messages to a prompt through the GGUF's own chat template (Jinja,
//! rendered by minijinja), as the model was trained; ChatML where the file
//! has no template.

use minijinja::{context, Environment};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ApiError;
use pagedattn_model::tokenizer::{Tokenizer, END_OF_TURN, IM_END, IM_START, START_OF_TURN};

/// The roles a conversation may hold (OpenAI's `developer` is a system
/// message to this model).
const ROLES: [&str; 4] = ["system", "developer", "user", "assistant"];

/// One chat message.
#[derive(Deserialize, Debug)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Value,
}

#[derive(Serialize)]
struct Turn {
    role: String,
    content: String,
}

/// A message's text: a string, or a list of `{"type": "text", "text": ...}`
/// parts (other parts are refused), or null.
fn text(i: usize, content: &Value) -> Result<String, ApiError> {
    let bad = |m: String| ApiError::param(&format!("messages[{i}].content"), m);
    match content {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (k, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    (Some(other), _) if other != "text" => {
                        return Err(bad(format!(
                            "messages[{i}].content[{k}] is of type {other:?}; this model reads text parts only"
                        )))
                    }
                    _ => {
                        return Err(bad(format!(
                            "messages[{i}].content[{k}] must be {{\"type\": \"text\", \"text\": ...}}"
                        )))
                    }
                }
            }
            Ok(out)
        }
        _ => Err(bad(format!(
            "messages[{i}].content must be a string or a list of text parts"
        ))),
    }
}

/// The prompt of a conversation, ending where the assistant's answer
/// starts. Encode it with specials parsed.
pub fn render(tokenizer: &Tokenizer, messages: &[Message]) -> Result<String, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::param("messages", "messages is empty"));
    }
    let mut turns = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        if !ROLES.contains(&m.role.as_str()) {
            return Err(ApiError::param(
                &format!("messages[{i}].role"),
                format!(
                    "messages[{i}].role {:?} is not one of system, developer, user, assistant",
                    m.role
                ),
            ));
        }
        let role = if m.role == "developer" {
            "system"
        } else {
            &m.role
        };
        turns.push(Turn {
            role: role.to_string(),
            content: text(i, &m.content)?,
        });
    }
    let Some(template) = tokenizer.chat_template() else {
        if tokenizer.token_id(START_OF_TURN).is_some() && tokenizer.token_id(IM_START).is_none() {
            // Gemma (its GGUF carries no template): BOS, then turns; the
            // assistant is "model", and a system message opens the first
            // user turn.
            let bos = tokenizer
                .bos_token_id()
                .and_then(|id| tokenizer.token_str(id))
                .unwrap_or("");
            let mut s = bos.to_string();
            let mut pending_system = String::new();
            for t in &turns {
                match t.role.as_str() {
                    "system" => pending_system += &format!("{}\n\n", t.content),
                    role => {
                        let role = if role == "assistant" { "model" } else { role };
                        let body = std::mem::take(&mut pending_system) + &t.content;
                        s += &format!("{START_OF_TURN}{role}\n{body}{END_OF_TURN}\n");
                    }
                }
            }
            return Ok(s + START_OF_TURN + "model\n");
        }
        let mut s = String::new();
        for t in &turns {
            s += &format!("{IM_START}{}\n{}{IM_END}\n", t.role, t.content);
        }
        return Ok(s + IM_START + "assistant\n");
    };
    let mut env = Environment::new();
    // Templates call it to refuse a conversation they cannot render.
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_template("chat", template)
        .map_err(|e| ApiError::server(format!("the model's chat template does not parse: {e}")))?;
    let tpl = env
        .get_template("chat")
        .map_err(|e| ApiError::server(e.to_string()))?;
    let eos = tokenizer.token_str(tokenizer.eos_id()).unwrap_or("");
    tpl.render(context! {
        messages => turns,
        add_generation_prompt => true,
        eos_token => eos,
        bos_token => "",
    })
    .map_err(|e| ApiError::invalid(format!("the chat template refused the messages: {e}")))
}
