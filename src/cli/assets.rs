//! The man pages, from their Markdown sources in `docs/`, and the shell
//! completions, from the command-line definition: both generated for the
//! package (`vllm-warden assets DIR`, hidden), never kept by hand.

use std::path::Path;

use crate::cli::args::Cli;

/// Write `man/` and `completions/` into `dir`.
pub(crate) fn write(dir: &Path) -> std::io::Result<()> {
    let man = dir.join("man");
    let comp = dir.join("completions");
    std::fs::create_dir_all(&man)?;
    std::fs::create_dir_all(&comp)?;
    let page = |md: &str, title: &str, section: u8| mandown::convert(&for_man(md), title, section);
    std::fs::write(man.join("vllm-warden.8"), page(include_str!("../../docs/vllm-warden.8.md"), "VLLM-WARDEN", 8))?;
    std::fs::write(
        man.join("vllm-warden.toml.5"),
        page(include_str!("../../docs/vllm-warden.toml.5.md"), "VLLM-WARDEN.TOML", 5),
    )?;
    for (shell, file) in [
        (clap_complete::Shell::Bash, "vllm-warden.bash"),
        (clap_complete::Shell::Zsh, "_vllm-warden"),
        (clap_complete::Shell::Fish, "vllm-warden.fish"),
    ] {
        std::fs::write(comp.join(file), completion(shell))?;
    }
    Ok(())
}

/// The completion script of `shell`.
pub(crate) fn completion(shell: clap_complete::Shell) -> Vec<u8> {
    use clap::CommandFactory;
    let mut out = Vec::new();
    if shell != clap_complete::Shell::Bash {
        clap_complete::generate(shell, &mut Cli::command(), "vllm-warden", &mut out);
        return out;
    }
    // clap_complete's bash script spells the states of a hyphenated name
    // two ways, so nothing past the first word completes (clap#6421): it
    // is made for a name without a hyphen, then bound to the real one.
    clap_complete::generate(shell, &mut Cli::command(), BASH_NAME, &mut out);
    let text = String::from_utf8_lossy(&out);
    let mut fixed = String::with_capacity(text.len());
    for line in text.lines() {
        match line.strip_suffix(&format!(" {BASH_NAME}")).filter(|l| l.trim_start().starts_with("complete ")) {
            Some(head) => fixed.push_str(&format!("{head} vllm-warden")),
            None => fixed.push_str(line),
        }
        fixed.push('\n');
    }
    fixed.into_bytes()
}

/// The name the bash script is made for: its function is `_vllm_warden`.
const BASH_NAME: &str = "vllm_warden";

/// Markdown as the man page converter renders well: table rows become
/// list items (the header row a sentence), code spans plain text. A row
/// of a `key | default | meaning` table reads `key (default: …): meaning`;
/// of another table of three, `first: second (third)`.
fn for_man(md: &str) -> String {
    let mut out = String::new();
    let mut header: Option<Vec<String>> = None;
    for line in md.lines() {
        let t = line.trim();
        if t.starts_with('|') {
            let cells: Vec<&str> = t.trim_matches('|').split('|').map(str::trim).collect();
            if cells.iter().all(|c| c.chars().all(|ch| ch == '-' || ch == ':')) {
                continue;
            }
            let Some(head) = &header else {
                header = Some(cells.iter().map(|c| c.to_string()).collect());
                continue;
            };
            let defaults = head.get(1).is_some_and(|h| h == "default");
            match cells.as_slice() {
                [key, default, meaning] if defaults => {
                    out.push_str(&format!("- **{key}** (default: {default}): {meaning}\n"))
                }
                [a, b, c] => out.push_str(&format!("- **{a}**: {b} ({c})\n")),
                [a, rest @ ..] => out.push_str(&format!("- **{a}**: {}\n", rest.join("; "))),
                [] => {}
            }
        } else {
            header = None;
            out.push_str(line);
            out.push('\n');
        }
    }
    out.replace('`', "")
}

#[cfg(test)]
mod tests {
    #[test]
    fn tables_become_lists_that_read_well() {
        let md = "| key | default | meaning |\n|---|---|---|\n| `a` | 1 | the a |\n\n| code | meaning | commands |\n|---|---|---|\n| 77 | denied | `status`, `drain` |\n";
        let man = super::for_man(md);
        assert!(man.contains("- **a** (default: 1): the a\n"), "{man}");
        assert!(man.contains("- **77**: denied (status, drain)\n"), "{man}");
    }
}
