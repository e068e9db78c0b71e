//! Every request field the server knows, in three kinds: served, accepted
//! and ignored (they change nothing in a local server), and refused (the
//! server does not do what they ask: a 400 naming the field, never a
//! silent no-op). A field of none of these is unknown: listed in a
//! warning and otherwise ignored, as vLLM does. README.md's field table
//! lists the same.

use serde_json::{Map, Value};

use crate::api::Route;
use crate::ApiError;

/// Served on both routes.
pub const SERVED: &[&str] = &[
    "model",
    "max_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "stream",
    "stream_options",
    "use_beam_search",
    "cache_salt",
    "return_tokens_as_token_ids",
    "expected_output_tokens",
];
/// Served on `/v1/completions` only.
pub const COMPLETIONS_ONLY: &[&str] = &["prompt", "echo"];
/// Served on `/v1/chat/completions` only.
pub const CHAT_ONLY: &[&str] = &["messages", "max_completion_tokens", "top_logprobs"];
/// Accepted and ignored: what they ask for changes nothing here.
pub const ACCEPTED: &[&str] = &[
    "user",
    "store",
    "metadata",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
];

/// A refused field: its name, and what it asks for that is not here.
struct Refused {
    name: &'static str,
    /// Whether a value asks for nothing (it is then accepted: `null`
    /// always is).
    harmless: fn(&Value, &Map<String, Value>) -> bool,
    why: &'static str,
}

fn never(_: &Value, _: &Map<String, Value>) -> bool {
    false
}
fn empty_list(v: &Value, _: &Map<String, Value>) -> bool {
    v.as_array().is_some_and(Vec::is_empty)
}
fn none_choice(v: &Value, _: &Map<String, Value>) -> bool {
    v.as_str() == Some("none")
}
fn is_false(v: &Value, _: &Map<String, Value>) -> bool {
    v.as_bool() == Some(false)
}
fn text_format(v: &Value, _: &Map<String, Value>) -> bool {
    v.get("type").and_then(Value::as_str) == Some("text")
}
fn text_modality(v: &Value, _: &Map<String, Value>) -> bool {
    v.as_array()
        .is_some_and(|a| a.iter().all(|m| m.as_str() == Some("text")))
}
fn best_of_n(v: &Value, body: &Map<String, Value>) -> bool {
    let n = body.get("n").and_then(Value::as_u64).unwrap_or(1);
    v.as_u64() == Some(n)
}
fn empty_text(v: &Value, _: &Map<String, Value>) -> bool {
    v.as_str() == Some("")
}
fn zero(v: &Value, _: &Map<String, Value>) -> bool {
    v.as_u64() == Some(0)
}

const REFUSED: &[Refused] = &[
    Refused {
        name: "tools",
        harmless: empty_list,
        why: "this server has no tool calling: the model answers in text",
    },
    Refused {
        name: "tool_choice",
        harmless: none_choice,
        why: "this server has no tool calling (only \"none\" is accepted)",
    },
    Refused {
        name: "functions",
        harmless: empty_list,
        why: "this server has no function calling: the model answers in text",
    },
    Refused {
        name: "function_call",
        harmless: none_choice,
        why: "this server has no function calling (only \"none\" is accepted)",
    },
    Refused {
        name: "parallel_tool_calls",
        harmless: is_false,
        why: "this server has no tool calls to run in parallel (only false is accepted)",
    },
    Refused {
        name: "response_format",
        harmless: text_format,
        why: "structured outputs (json_object, json_schema) are not supported yet; only {\"type\": \"text\"} is accepted",
    },
    Refused {
        name: "audio",
        harmless: never,
        why: "this server answers in text only",
    },
    Refused {
        name: "modalities",
        harmless: text_modality,
        why: "this server answers in text only (only [\"text\"] is accepted)",
    },
    Refused {
        name: "prediction",
        harmless: never,
        why: "predicted outputs are not supported",
    },
    Refused {
        name: "web_search_options",
        harmless: never,
        why: "this server does not search the web",
    },
    Refused {
        name: "reasoning_effort",
        harmless: never,
        why: "the served model does not reason in a separate channel",
    },
    Refused {
        name: "best_of",
        harmless: best_of_n,
        why: "best_of other than n is not supported (use n, or use_beam_search)",
    },
    Refused {
        name: "suffix",
        harmless: empty_text,
        why: "insertion (a suffix after the completion) is not supported",
    },
    Refused {
        name: "prompt_logprobs",
        harmless: never,
        why: "the prompt's logprobs are not computed",
    },
    Refused {
        name: "min_tokens",
        harmless: zero,
        why: "min_tokens is not supported (only 0 is accepted)",
    },
    Refused {
        name: "guided_json",
        harmless: never,
        why: "structured outputs are not supported yet",
    },
    Refused {
        name: "guided_regex",
        harmless: never,
        why: "structured outputs are not supported yet",
    },
    Refused {
        name: "guided_choice",
        harmless: never,
        why: "structured outputs are not supported yet",
    },
    Refused {
        name: "guided_grammar",
        harmless: never,
        why: "structured outputs are not supported yet",
    },
    Refused {
        name: "structured_outputs",
        harmless: never,
        why: "structured outputs are not supported yet",
    },
];

/// The names of every refused field.
#[cfg(test)]
pub fn refused_names() -> impl Iterator<Item = &'static str> {
    REFUSED.iter().map(|r| r.name)
}

/// Checks `body`'s fields for `route`: a 400 naming the first refused
/// field whose value asks for something; otherwise the unknown fields,
/// sorted, for the caller's warning.
pub fn check(route: Route, body: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    let route_only = match route {
        Route::Completions => COMPLETIONS_ONLY,
        Route::Chat => CHAT_ONLY,
    };
    // The refused fields in the table's order (tools before tool_choice),
    // so a request with several names its main one.
    for r in REFUSED {
        let Some(value) = body.get(r.name) else {
            continue;
        };
        if value.is_null() || (r.harmless)(value, body) {
            continue;
        }
        return Err(ApiError::param(
            r.name,
            format!("{} is not supported by this server: {}", r.name, r.why),
        ));
    }
    let known = |name: &str| {
        SERVED.contains(&name)
            || route_only.contains(&name)
            || ACCEPTED.contains(&name)
            || REFUSED.iter().any(|r| r.name == name)
    };
    let mut unknown: Vec<String> = body.keys().filter(|n| !known(n)).cloned().collect();
    unknown.sort();
    Ok(unknown)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().expect("an object")
    }

    #[test]
    fn refused_fields_name_themselves_and_harmless_values_pass() {
        for (body, field) in [
            (json!({"tools": [{"type": "function"}]}), "tools"),
            (json!({"tool_choice": "auto"}), "tool_choice"),
            (json!({"functions": [{"name": "f"}]}), "functions"),
            (json!({"function_call": {"name": "f"}}), "function_call"),
            (json!({"parallel_tool_calls": true}), "parallel_tool_calls"),
            (
                json!({"response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {}}}),
                "response_format",
            ),
            (json!({"audio": {"voice": "x"}}), "audio"),
            (json!({"modalities": ["text", "audio"]}), "modalities"),
            (json!({"prediction": {"type": "content"}}), "prediction"),
            (json!({"web_search_options": {}}), "web_search_options"),
            (json!({"best_of": 3}), "best_of"),
            (json!({"n": 2, "best_of": 3}), "best_of"),
            (json!({"suffix": "end"}), "suffix"),
            (json!({"min_tokens": 4}), "min_tokens"),
            (json!({"guided_json": {}}), "guided_json"),
        ] {
            let e = check(Route::Chat, &obj(body.clone())).unwrap_err();
            let b = e.body();
            assert_eq!(b["error"]["param"], field, "{body}");
            let msg = b["error"]["message"].as_str().unwrap_or("");
            assert!(msg.contains("not supported"), "{body}: {msg}");
        }
        for body in [
            json!({"tools": [], "tool_choice": "none", "parallel_tool_calls": false}),
            json!({"response_format": {"type": "text"}, "modalities": ["text"]}),
            json!({"functions": null, "function_call": "none", "audio": null}),
            json!({"n": 3, "best_of": 3, "suffix": "", "min_tokens": 0}),
            json!({"user": "u", "store": false, "metadata": {"a": "b"}, "service_tier": "auto"}),
        ] {
            assert_eq!(check(Route::Chat, &obj(body.clone())), Ok(vec![]), "{body}");
        }
    }

    #[test]
    fn unknown_fields_are_listed_and_route_fields_kept_apart() {
        let body = obj(json!({"temperature": 1, "zeta": 1, "alpha": 2, "echo": true}));
        assert_eq!(
            check(Route::Chat, &body),
            Ok(vec!["alpha".into(), "echo".into(), "zeta".into()])
        );
        assert_eq!(
            check(Route::Completions, &body),
            Ok(vec!["alpha".into(), "zeta".into()])
        );
        // No field is in two kinds.
        let mut all: Vec<&str> = SERVED
            .iter()
            .chain(COMPLETIONS_ONLY)
            .chain(CHAT_ONLY)
            .chain(ACCEPTED)
            .copied()
            .chain(refused_names())
            .collect();
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n);
    }

    /// README.md's field table, row by row, names exactly these lists.
    #[test]
    fn the_readme_table_names_every_field_in_its_kind() {
        let readme = include_str!("../../README.md");
        let row = |start: &str| -> Vec<String> {
            let line = readme
                .lines()
                .find(|l| l.trim_start().starts_with(start))
                .unwrap_or_else(|| panic!("README.md has no row {start:?}"));
            let cells: Vec<&str> = line.split(" | ").collect();
            let fields = cells.last().expect("a cell");
            // Each field is the first backticked word of a comma-separated item.
            let mut names: Vec<String> = fields
                .split(", `")
                .filter_map(|item| {
                    let item = item.trim_start_matches('`');
                    item.split('`').next().map(str::to_string)
                })
                .collect();
            names.sort();
            names
        };
        let sorted = |x: Vec<&str>| {
            let mut v: Vec<String> = x.into_iter().map(String::from).collect();
            v.sort();
            v
        };
        assert_eq!(row("| served, both routes"), sorted(SERVED.to_vec()));
        assert_eq!(
            row("| served, completions"),
            sorted(COMPLETIONS_ONLY.to_vec())
        );
        assert_eq!(row("| served, chat"), sorted(CHAT_ONLY.to_vec()));
        assert_eq!(row("| accepted"), sorted(ACCEPTED.to_vec()));
        assert_eq!(row("| refused"), sorted(refused_names().collect()));
    }
}
