//! The spec as an ordered tree, written as YAML or JSON. CDI readers take either (a JSON document
//! is YAML too); people read YAML. Keys keep the order the spec is built in (`cdiVersion`, `kind`,
//! `devices`, then each device's `name` before its edits), which a map type would sort away.
//!
//! Every scalar is written as a JSON string literal: in YAML that is a double-quoted scalar with
//! the same escapes, so no value (a path with `: `, a `#`, a leading `-`) can ever change the
//! document's structure, and nothing needs a YAML library.

#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    Str(String),
    Int(u64),
    List(Vec<Node>),
    Map(Vec<(String, Node)>),
}

pub fn s(v: impl Into<String>) -> Node {
    Node::Str(v.into())
}

pub fn list<I: IntoIterator<Item = Node>>(items: I) -> Node {
    Node::List(items.into_iter().collect())
}

pub fn map<K: Into<String>, I: IntoIterator<Item = (K, Node)>>(entries: I) -> Node {
    Node::Map(entries.into_iter().map(|(k, v)| (k.into(), v)).collect())
}

fn quoted(v: &str) -> String {
    serde_json::to_string(v).expect("a string always serialises")
}

impl Node {
    /// Pretty JSON, two-space indents, one trailing newline.
    pub fn to_json(&self) -> String {
        let mut out = String::new();
        self.json_into(&mut out, 0);
        out.push('\n');
        out
    }

    fn json_into(&self, out: &mut String, depth: usize) {
        let pad = |d: usize| "  ".repeat(d);
        match self {
            Node::Str(v) => out.push_str(&quoted(v)),
            Node::Int(n) => out.push_str(&n.to_string()),
            Node::List(items) if items.is_empty() => out.push_str("[]"),
            Node::Map(entries) if entries.is_empty() => out.push_str("{}"),
            Node::List(items) => {
                out.push_str("[\n");
                for (i, item) in items.iter().enumerate() {
                    out.push_str(&pad(depth + 1));
                    item.json_into(out, depth + 1);
                    out.push_str(if i + 1 < items.len() { ",\n" } else { "\n" });
                }
                out.push_str(&pad(depth));
                out.push(']');
            }
            Node::Map(entries) => {
                out.push_str("{\n");
                for (i, (k, v)) in entries.iter().enumerate() {
                    out.push_str(&format!("{}{}: ", pad(depth + 1), quoted(k)));
                    v.json_into(out, depth + 1);
                    out.push_str(if i + 1 < entries.len() { ",\n" } else { "\n" });
                }
                out.push_str(&pad(depth));
                out.push('}');
            }
        }
    }

    /// Block-style YAML after `header` (comment lines, each starting with `#`).
    pub fn to_yaml(&self, header: &str) -> String {
        let mut out = String::from(header);
        match self {
            Node::Map(entries) if !entries.is_empty() => yaml_map(entries, &mut out, 0),
            other => {
                out.push_str(&other.yaml_inline().unwrap_or_default());
                out.push('\n');
            }
        }
        out
    }

    /// A scalar or an empty collection, written on the line of its key.
    fn yaml_inline(&self) -> Option<String> {
        match self {
            Node::Str(v) => Some(quoted(v)),
            Node::Int(n) => Some(n.to_string()),
            Node::List(v) if v.is_empty() => Some("[]".into()),
            Node::Map(v) if v.is_empty() => Some("{}".into()),
            _ => None,
        }
    }
}

/// A key as written: plain when it is an identifier (every key the spec uses), else quoted.
fn yaml_key(k: &str) -> String {
    let plain = k.starts_with(|c: char| c.is_ascii_alphabetic()) && k.chars().all(|c| c.is_ascii_alphanumeric());
    if plain { k.to_string() } else { quoted(k) }
}

fn yaml_map(entries: &[(String, Node)], out: &mut String, depth: usize) {
    for (k, v) in entries {
        out.push_str(&"  ".repeat(depth));
        out.push_str(&yaml_key(k));
        out.push(':');
        yaml_value(v, out, depth);
    }
}

/// After `key:` or `-`: an inline value on the same line, or a nested block below it.
fn yaml_value(v: &Node, out: &mut String, depth: usize) {
    if let Some(inline) = v.yaml_inline() {
        out.push(' ');
        out.push_str(&inline);
        out.push('\n');
        return;
    }
    out.push('\n');
    match v {
        Node::Map(entries) => yaml_map(entries, out, depth + 1),
        Node::List(items) => {
            for item in items {
                out.push_str(&"  ".repeat(depth + 1));
                out.push('-');
                match item {
                    // `- key: value` with the map's other keys under the first.
                    Node::Map(entries) if !entries.is_empty() => {
                        let mut nested = String::new();
                        yaml_map(entries, &mut nested, depth + 2);
                        out.push(' ');
                        out.push_str(nested.trim_start());
                    }
                    other => yaml_value(other, out, depth + 1),
                }
            }
        }
        _ => unreachable!("scalars are inline"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Node {
        map([
            ("cdiVersion", s("0.3.0")),
            ("devices", list([map([("name", s("a: #b")), ("opts", list([s("ro"), s("-x")])), ("empty", list([]))])])),
            ("n", Node::Int(30)),
            ("odd key", s("v")),
        ])
    }

    #[test]
    fn yaml_is_block_style_with_every_scalar_quoted() {
        let y = sample().to_yaml("# head\n");
        assert_eq!(
            y,
            "# head\ncdiVersion: \"0.3.0\"\ndevices:\n  - name: \"a: #b\"\n    opts:\n      - \"ro\"\n      - \"-x\"\n    empty: []\nn: 30\n\"odd key\": \"v\"\n"
        );
    }

    #[test]
    fn json_round_trips_through_serde() {
        let j = sample().to_json();
        let v: serde_json::Value = serde_json::from_str(&j).unwrap();
        assert_eq!(v["devices"][0]["name"], "a: #b");
        assert_eq!(v["devices"][0]["opts"][1], "-x");
        assert_eq!(v["n"], 30);
        // Key order is the build order, not sorted.
        assert!(j.find("cdiVersion").unwrap() < j.find("devices").unwrap());
        assert!(j.find("\"name\"").unwrap() < j.find("\"opts\"").unwrap());
    }
}
