//! The man pages, from their Markdown sources in `docs/`, and the shell
//! completions, from the command-line definition: both generated for the
//! package (`vllm-warden assets DIR`, hidden), never kept by hand.

use std::path::Path;

use crate::cli::args::Cli;

/// Write `man/` and `completions/` into `dir`.
pub fn write(dir: &Path) -> std::io::Result<()> {
    use clap::CommandFactory;
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
        let mut out = Vec::new();
        clap_complete::generate(shell, &mut Cli::command(), "vllm-warden", &mut out);
        std::fs::write(comp.join(file), out)?;
    }
    Ok(())
}

/// Markdown as the man page converter renders well: table rows become
/// list items (the header row a sentence), code spans plain text.
fn for_man(md: &str) -> String {
    let mut out = String::new();
    let mut header = true;
    for line in md.lines() {
        let t = line.trim();
        if t.starts_with('|') {
            let cells: Vec<&str> = t.trim_matches('|').split('|').map(str::trim).collect();
            if cells.iter().all(|c| c.chars().all(|ch| ch == '-' || ch == ':')) {
                continue;
            }
            if header {
                header = false;
                continue;
            }
            match cells.as_slice() {
                [key, default, meaning] => out.push_str(&format!("- **{key}** (default: {default}): {meaning}\n")),
                [a, rest @ ..] => out.push_str(&format!("- **{a}**: {}\n", rest.join("; "))),
                [] => {}
            }
        } else {
            header = true;
            out.push_str(line);
            out.push('\n');
        }
    }
    out.replace('`', "")
}
