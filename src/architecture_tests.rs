//! The rooms, checked: the engine's core imports nothing from the harness, the dashboard, the
//! CLI, the hub client or training, and the modules two levels down (`engine::model`,
//! `harness::race`, `tui::app`, …) form no import cycle, and the engine uses no thread pool but
//! its own. Reads the sources as text: every `crate::…` and `super::…` path outside comments
//! and unit tests is an import.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// How deep a module path is kept: `engine::model`, not `engine::model::host`.
const DEPTH: usize = 2;

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src/engine/model/host.rs` → `[engine, model, host]`; a `mod.rs` is its directory.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file
        .strip_prefix(src)
        .expect("under src")
        .with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into()).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// The code of `text` without line comments and without its unit-test module.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]\nmod tests").next().unwrap_or(text);
    text.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The module paths `text`, in module `module`, names through `crate::` or `super::`.
fn imports(module: &[String], text: &str) -> Vec<Vec<String>> {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut found = Vec::new();
    for (at, _) in text
        .match_indices("crate::")
        .chain(text.match_indices("super::"))
    {
        if text[..at].ends_with(is_ident) {
            continue;
        }
        let path: String = text[at..].chars().take_while(|&c| is_ident(c)).collect();
        let mut parts: Vec<&str> = path.split("::").filter(|p| !p.is_empty()).collect();
        let mut base: Vec<String> = match parts.first() {
            Some(&"crate") => Vec::new(),
            _ => module[..module.len().saturating_sub(1)].to_vec(),
        };
        parts.remove(0);
        while parts.first() == Some(&"super") {
            base.pop();
            parts.remove(0);
        }
        base.extend(parts.iter().map(|p| p.to_string()));
        found.push(base);
    }
    found
}

fn edges() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let key = |p: &[String]| p[..p.len().min(DEPTH)].join("::");
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let module = module_of(&src, &file);
        let text = code(&std::fs::read_to_string(&file).expect("a source file"));
        for target in imports(&module, &text) {
            let (from, to) = (key(&module), key(&target));
            if from != to && !to.is_empty() && !from.is_empty() {
                edges.entry(from).or_default().insert(to);
            }
        }
    }
    edges
}

#[test]
fn the_core_imports_nothing_from_the_rooms_around_it() {
    for (from, to) in edges() {
        if from.starts_with("engine") {
            let outside: Vec<_> = (to.iter())
                .filter(|t| {
                    ["harness", "tui", "cli", "train", "hub"]
                        .contains(&&t[..t.find("::").unwrap_or(t.len())])
                })
                .collect();
            assert!(outside.is_empty(), "{from} imports {outside:?}");
        }
    }
}

#[test]
fn modules_form_no_import_cycle() {
    let edges = edges();
    // Depth-first search for a back edge, reporting the cycle it closes.
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) {
        if let Some(at) = path.iter().position(|p| p == node) {
            panic!("import cycle: {} -> {node}", path[at..].join(" -> "));
        }
        if done.contains(node) {
            return;
        }
        path.push(node.to_string());
        for next in edges.get(node).into_iter().flatten() {
            visit(next, edges, path, done);
        }
        path.pop();
        done.insert(node.to_string());
    }
    let mut done = BTreeSet::new();
    for node in edges.keys() {
        visit(node, &edges, &mut Vec::new(), &mut done);
    }
}

/// The engine's host kernels run on the decode threads of their own pool and nowhere else, so
/// `--threads N` is what a step uses: no engine module reaches for rayon's process-wide pool,
/// which has a thread for every core whatever `--threads` says.
#[test]
fn the_engine_threads_only_through_its_own_pool() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src.join("engine"), &mut files);
    for file in files {
        let text = code(&std::fs::read_to_string(&file).expect("a source file"));
        assert!(!text.contains("rayon"), "{} uses rayon", file.display());
    }
}

/// Comments say why; the commit that measured something says how much, and on what. So no
/// comment in `src/` names a CPU or GPU model (a figure measured on one belongs in the commit
/// body that measured it).
#[test]
fn no_comment_names_a_machine() {
    const MACHINES: [&str; 10] = [
        "EPYC",
        "Xeon",
        "Ryzen",
        "Zen 2",
        "Zen 3",
        "Zen 4",
        "Zen 5",
        "Sapphire Rapids",
        "H100",
        "H200",
    ];
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    for file in files {
        let text = std::fs::read_to_string(&file).expect("a source file");
        for (n, line) in text.lines().enumerate() {
            let Some((_, comment)) = line.split_once("//") else {
                continue;
            };
            let named = MACHINES.iter().find(|m| comment.contains(*m));
            assert!(
                named.is_none(),
                "{}:{}: a comment names {named:?}",
                file.display(),
                n + 1
            );
        }
    }
}
