//! A problem found in a config file, with its place.

use std::fmt;
use std::path::PathBuf;

/// One problem found in a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub file: PathBuf,
    /// 1-based line and column, when the problem has a place in the TOML.
    pub at: Option<(usize, usize)>,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The file's name is someone's: shown, never acted on by a terminal.
        let file = crate::util::escape::one_line(&self.file.display().to_string(), crate::util::escape::MAX_LINE);
        match self.at {
            Some((line, col)) => write!(f, "{file}:{line}:{col}: {}", self.message),
            None => write!(f, "{file}: {}", self.message),
        }
    }
}

/// Every problem of a config that did not validate.
#[derive(Debug, Clone, thiserror::Error)]
pub struct Problems(pub Vec<Problem>);

impl fmt::Display for Problems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}
