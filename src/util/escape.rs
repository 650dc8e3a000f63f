//! Text from data made safe for where it goes. A log line, a process's
//! command line or a file's content must never become protocol (a second
//! line in a notify datagram is a second field) or terminal control (an
//! escape sequence from someone's argv): control characters are shown as
//! visible escapes and the length is capped. Nothing here knows where the
//! text came from.

/// How long a `STATUS=` (and any other one-line human field) may be.
pub(crate) const MAX_LINE: usize = 1024;

/// `text` as one visible line of at most `max` characters: C0 and C1
/// controls, DEL and the Unicode line and paragraph separators are written
/// as `\n`, `\r`, `\t`, `\x1b`, `\u{2028}`; a longer text is cut with `…`.
pub(crate) fn one_line(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max + 8));
    let mut chars = 0usize;
    for c in text.chars() {
        let piece: std::borrow::Cow<'_, str> = match c {
            '\n' => "\\n".into(),
            '\r' => "\\r".into(),
            '\t' => "\\t".into(),
            c if (c as u32) < 0x20 || c == '\u{7f}' => format!("\\x{:02x}", c as u32).into(),
            c if ('\u{80}'..='\u{9f}').contains(&c) || c == '\u{2028}' || c == '\u{2029}' => {
                format!("\\u{{{:x}}}", c as u32).into()
            }
            c => {
                let mut b = [0u8; 4];
                String::from(c.encode_utf8(&mut b)).into()
            }
        };
        let n = piece.chars().count();
        if chars + n > max {
            out.push('…');
            return out;
        }
        chars += n;
        out.push_str(&piece);
    }
    out
}

/// True for the characters [`one_line`] escapes.
#[cfg(test)]
pub(crate) fn is_unsafe(c: char) -> bool {
    (c as u32) < 0x20 || ('\u{7f}'..='\u{9f}').contains(&c) || c == '\u{2028}' || c == '\u{2029}'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_are_visible_and_never_a_line_break() {
        let s = one_line("x\nREADY=1\r\x1b[31mred\u{85}\u{2028}\u{7f}\t", 100);
        assert_eq!(s, "x\\nREADY=1\\r\\x1b[31mred\\u{85}\\u{2028}\\x7f\\t");
        assert!(!s.chars().any(is_unsafe));
    }

    #[test]
    fn long_text_is_cut() {
        assert_eq!(one_line("abcdef", 3), "abc…");
        assert_eq!(one_line("ab\ncd", 3), "ab…");
        assert_eq!(one_line("abc", 3), "abc");
    }
}
