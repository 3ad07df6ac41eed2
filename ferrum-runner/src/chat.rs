//! Chat templates: rendering a conversation into a prompt with the model's Jinja template.
//!
//! The environment is set up the way HF transformers' `apply_chat_template` sets up Jinja2:
//! `trim_blocks` and `lstrip_blocks`, loop controls, a `raise_exception(msg)` function that
//! aborts rendering, `strftime_now(fmt)` (in UTC, where HF uses local time), a `tojson` filter
//! that does not HTML-escape (Python `json.dumps(..., ensure_ascii=False)` formatting, `indent`
//! and `sort_keys` supported), and Python string/dict/list methods (`.strip()`,
//! `.startswith()`, `.items()`, `.get()`, ...) through `minijinja-contrib`'s pycompat layer.
//! Not supported: HF's `{% generation %}` block (assistant-mask tracking).
//!
//! The template sees `messages` (a list of `{role, content}` maps), `add_generation_prompt`,
//! `bos_token` and `eos_token`.
//!
//! A template comes from the model file, so rendering is limited: it may run
//! [`TEMPLATE_FUEL_BASE`] instructions plus [`TEMPLATE_FUEL_PER_MESSAGE`] per message (nested
//! loops could otherwise run for hours) and write [`TEMPLATE_OUTPUT_BASE`] bytes plus
//! [`TEMPLATE_OUTPUT_PER_INPUT_BYTE`] per byte of its inputs. Past either it fails with
//! [`Error::ChatTemplate`]. MiniJinja itself caps `range` at 100,000 items and a repeated
//! string (`"x" * n`) at 100 MB. **Memory is not limited:** MiniJinja has no memory budget,
//! and values built inside the template (`~` concatenation doubling a string in a loop, `{% set
//! %}` captures) cost little fuel and never pass through the output cap, so a hostile template
//! can still exhaust memory in a few dozen instructions. Use templates from model files you
//! trust, or pass `--chat` only with them.

use std::io;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Instructions any render may run. Real chat templates run a few dozen per message; a
/// million takes well under a second.
pub const TEMPLATE_FUEL_BASE: u64 = 1_000_000;
/// Further instructions per message.
pub const TEMPLATE_FUEL_PER_MESSAGE: u64 = 10_000;
/// Bytes any render may write.
pub const TEMPLATE_OUTPUT_BASE: usize = 1 << 20;
/// Further bytes per byte of the messages, BOS and EOS texts (a template may repeat them, say
/// as text and again as JSON).
pub const TEMPLATE_OUTPUT_PER_INPUT_BYTE: usize = 4;

/// Renders `messages` with the Jinja chat `template` (see the [module documentation](self)).
///
/// Errors with [`Error::ChatTemplate`] when the template is empty, does not parse, calls
/// `raise_exception`, fails while rendering, or runs past its instruction or output budget.
pub fn render_chat(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    if template.trim().is_empty() {
        return Err(Error::ChatTemplate("the chat template is empty".to_string()));
    }
    let fuel = TEMPLATE_FUEL_BASE.saturating_add(TEMPLATE_FUEL_PER_MESSAGE.saturating_mul(messages.len() as u64));
    let input_bytes = messages
        .iter()
        .map(|m| m.role.len().saturating_add(m.content.len()))
        .fold(bos_token.len().saturating_add(eos_token.len()), usize::saturating_add);
    let max_output = TEMPLATE_OUTPUT_BASE.saturating_add(input_bytes.saturating_mul(TEMPLATE_OUTPUT_PER_INPUT_BYTE));

    let mut env = environment();
    env.set_fuel(Some(fuel));
    let tmpl = env.template_from_str(template).map_err(|e| template_error("invalid chat template", &e))?;
    let mut out = CappedOutput { buf: Vec::new(), max: max_output, overflowed: false };
    let rendered = tmpl.render_captured_to(
        minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        },
        &mut out,
    );
    if out.overflowed {
        return Err(Error::ChatTemplate(format!("the chat template wrote more than {max_output} bytes")));
    }
    rendered.map_err(|e| template_error("rendering the chat template failed", &e))?;
    // MiniJinja writes whole `str`s, so the bytes are UTF-8; checked all the same.
    String::from_utf8(out.buf).map_err(|e| Error::ChatTemplate(format!("the chat template wrote invalid UTF-8: {e}")))
}

/// The render's output, refusing (with an I/O error, which stops the render) any write that
/// would take it past `max` bytes.
struct CappedOutput {
    buf: Vec<u8>,
    max: usize,
    overflowed: bool,
}

impl io::Write for CappedOutput {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if data.len() > self.max.saturating_sub(self.buf.len()) {
            self.overflowed = true;
            return Err(io::Error::other("chat template output limit reached"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn template_error(what: &str, e: &minijinja::Error) -> Error {
    if e.kind() == ErrorKind::InvalidOperation {
        if let Some(msg) = e.detail().and_then(|d| d.strip_prefix(RAISED)) {
            return Error::ChatTemplate(format!("the chat template raised an exception: {msg}"));
        }
    }
    if e.kind() == ErrorKind::OutOfFuel {
        return Error::ChatTemplate("the chat template ran out of its instruction budget (runaway loop?)".to_string());
    }
    let mut msg = format!("{what}: {e}");
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    Error::ChatTemplate(msg)
}

const RAISED: &str = "raise_exception: ";

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, minijinja::Error> {
        Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("{RAISED}{msg}")))
    });
    env.add_function("strftime_now", |fmt: String| strftime_utc(&fmt, now_unix()));
    env.add_filter("tojson", tojson);
    env
}

/// HF's `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<String, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                let n = i64::try_from(v.clone())
                    .map_err(|_| minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: bad indent"))?;
                Some(" ".repeat(n.clamp(0, 64) as usize))
            }
        },
    };
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_py_json(&json, indent.as_deref(), sort_keys.unwrap_or(false), 0, &mut out);
    Ok(out)
}

/// Python `json.dumps` layout: `", "`/`": "` separators, or newline + indent per level.
fn write_py_json(v: &serde_json::Value, indent: Option<&str>, sort_keys: bool, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(ind) = indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_py_json(item, indent, sort_keys, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            let mut entries: Vec<(&String, &serde_json::Value)> = map.iter().collect();
            if sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::Value::String(k.clone()).to_string());
                out.push_str(": ");
                write_py_json(item, indent, sort_keys, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        J::Array(_) => out.push_str("[]"),
        J::Object(_) => out.push_str("{}"),
        scalar => out.push_str(&scalar.to_string()),
    }
}

fn now_unix() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

/// A small `strftime` over UTC time: `%Y %y %m %d %e %H %I %M %S %p %b %B %a %A %j %%`;
/// other directives are copied through.
pub fn strftime_utc(fmt: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// (year, month, day) to days since 1970-01-01.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_dates() {
        assert_eq!(strftime_utc("%Y-%m-%d %H:%M:%S", 0), "1970-01-01 00:00:00");
        // 2024-07-26 13:05:09 UTC, a Friday.
        assert_eq!(strftime_utc("%d %b %Y %A %j %I%p %%", 1_722_000_309), "26 Jul 2024 Friday 208 01PM %");
        assert_eq!(strftime_utc("%B %e", 951_782_400), "February 29"); // 2000-02-29
    }

    #[test]
    fn tojson_is_python_style() {
        let out = render_chat(
            "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=true) }}",
            &[ChatMessage::user("<b> & \"q\" é")],
            false,
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            out,
            "[{\"content\": \"<b> & \\\"q\\\" é\", \"role\": \"user\"}]|{\n  \"content\": \"<b> & \\\"q\\\" é\",\n  \"role\": \"user\"\n}"
        );
    }
}
