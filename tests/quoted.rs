//! Code the docs quote from a compiled file is that file, byte for byte: a
//! fenced block right after `<!-- quote: PATH -->` in README.md or docs/*.md
//! must equal the file at PATH (relative to the repository root). The README's
//! first example and the HTTP guide's server are quoted this way from
//! `examples/start/`, which CI builds as a user's crate would.

use std::path::{Path, PathBuf};

const MARK: &str = "<!-- quote: ";

/// One quote: where it is, the file it names, and the block's text.
struct Quote {
    doc: PathBuf,
    line: usize,
    source: String,
    block: String,
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn docs() -> Vec<PathBuf> {
    let mut docs = vec![root().join("README.md")];
    let mut guides: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|entry| entry.expect("docs/ entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    guides.sort();
    docs.extend(guides);
    docs
}

/// Every marked block of `doc`; a mark not followed by a fenced block fails.
fn quotes(doc: &Path) -> Vec<Quote> {
    let text = std::fs::read_to_string(doc).expect("read doc");
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (at, line) in lines.iter().enumerate() {
        let Some(rest) = line.trim().strip_prefix(MARK) else { continue };
        let source = rest.strip_suffix("-->").expect("a quote mark ends with -->").trim().to_owned();
        let fence = lines.get(at + 1).copied().unwrap_or_default();
        assert!(
            fence.starts_with("```"),
            "{}:{}: the quote of {source} is not followed by a code block",
            doc.display(),
            at + 1
        );
        let body: Vec<&str> = lines[at + 2..].iter().copied().take_while(|l| !l.starts_with("```")).collect();
        found.push(Quote { doc: doc.to_owned(), line: at + 1, source, block: body.join("\n") });
    }
    found
}

#[test]
fn quoted_code_is_the_compiled_file() {
    let all: Vec<Quote> = docs().iter().flat_map(|doc| quotes(doc)).collect();
    for quote in &all {
        let file = std::fs::read_to_string(root().join(&quote.source))
            .unwrap_or_else(|e| panic!("{}:{}: {}: {e}", quote.doc.display(), quote.line, quote.source));
        assert_eq!(
            quote.block.trim_end(),
            file.trim_end(),
            "{}:{} quotes {} but differs from it: copy the file into the block",
            quote.doc.display(),
            quote.line,
            quote.source
        );
    }
    // The path was taken: the two quotes this test exists for are there.
    let named = |doc: &str, source: &str| all.iter().any(|q| q.doc.ends_with(doc) && q.source == source);
    assert!(named("README.md", "examples/start/start.rs"), "README.md no longer quotes examples/start/start.rs");
    assert!(
        named("docs/http.md", "examples/start/server.rs"),
        "docs/http.md no longer quotes examples/start/server.rs"
    );
}
