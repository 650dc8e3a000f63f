//! Properties over random input of the two places where text from data
//! meets a protocol or a decision: the notify datagram (no line of it may
//! come from data) and the line classifier (any bytes in, a sane line out;
//! a fatal or ready line stays so whatever vLLM's prefix and colours).
//! 10 000 cases each.

use std::time::Duration;

use proptest::prelude::*;
use vllm_warden::config::profile::Profile;
use vllm_warden::supervisor::classify::{Class, Classifier, Splitter};
use vllm_warden::tell::notify::{Note, datagram};

const CASES: u32 = 10_000;

/// Any text, with control characters, separators and escapes well
/// represented.
fn hostile_text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        "[a-zA-Z0-9 =_.:/-]{0,12}",
        Just("\n".to_string()),
        Just("\r".to_string()),
        Just("\u{1b}[31m".to_string()),
        Just("\u{85}".to_string()),
        Just("\u{2028}".to_string()),
        Just("\u{2029}".to_string()),
        Just("\u{7f}".to_string()),
        Just("\0".to_string()),
        Just("READY=1".to_string()),
        Just("STATUS=".to_string()),
        Just("MAINPID=1".to_string()),
        any::<char>().prop_map(String::from),
    ];
    proptest::collection::vec(piece, 0..24).prop_map(|v| v.concat())
}

fn note() -> impl Strategy<Value = Note> {
    prop_oneof![
        Just(Note::Ready),
        Just(Note::Stopping),
        Just(Note::Watchdog),
        (0u64..u64::MAX / 2).prop_map(|us| Note::ExtendTimeout(Duration::from_micros(us))),
        hostile_text().prop_map(Note::Status),
    ]
}

thread_local! {
    /// Built once: compiling the profile's patterns costs more than a case.
    static VLLM: std::cell::RefCell<Classifier> =
        std::cell::RefCell::new(Classifier::new(&Profile::Vllm.patterns()).unwrap());
}

/// The lines the follower's splitter makes of `bytes`.
fn split(bytes: &[u8]) -> Vec<String> {
    let mut s = Splitter::default();
    let mut out = Vec::new();
    s.push(bytes, &mut out);
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: CASES, failure_persistence: None, ..ProptestConfig::default() })]

    /// One line per note, each the field the note is: no data-derived line.
    #[test]
    fn a_notify_datagram_has_one_line_per_note_whatever_the_text(notes in proptest::collection::vec(note(), 0..6)) {
        let msg = datagram(&notes);
        let lines: Vec<&str> = msg.split('\n').collect();
        prop_assert_eq!(lines.last(), Some(&""), "ends with a newline");
        let lines = &lines[..lines.len() - 1];
        prop_assert_eq!(lines.len(), notes.len(), "{:?}", msg);
        for (line, n) in lines.iter().zip(&notes) {
            let field = match n {
                Note::Ready => "READY=1",
                Note::Stopping => "STOPPING=1",
                Note::Watchdog => "WATCHDOG=1",
                Note::ExtendTimeout(_) => "EXTEND_TIMEOUT_USEC=",
                Note::Status(_) => "STATUS=",
            };
            prop_assert!(line.starts_with(field), "{:?} for {:?}", line, n);
            prop_assert!(!line.contains(['\r', '\u{85}', '\u{2028}', '\u{2029}', '\0', '\u{1b}']), "{:?}", line);
        }
    }

    /// Any bytes, as the follower reads them: every line split out holds no
    /// line break and no escape sequence and stays under the cap; each
    /// classifies without a panic, its message part of its text.
    #[test]
    fn any_bytes_split_and_classify_to_sane_lines(text in hostile_text(), raw in proptest::collection::vec(any::<u8>(), 0..64)) {
        for line in split(&[text.as_bytes(), &raw, b"\n"].concat()) {
            prop_assert!(!line.contains(['\n', '\r', '\u{1b}']), "{:?}", line);
            prop_assert!(line.len() <= 64 * 1024 + 4);
            let l = VLLM.with(|c| c.borrow_mut().classify(line));
            prop_assert!(l.text.contains(l.message.trim()), "{:?} / {:?}", l.text, l.message);
        }
    }

    /// A fatal line and the ready line keep their class whatever vLLM's
    /// process prefix, level word and colours around them.
    #[test]
    fn fatal_and_ready_lines_keep_their_class_under_any_prefix(
        proc_ in "(APIServer|EngineCore|Worker|Worker_TP[0-9])",
        pid in 1u32..4_000_000,
        level in "(INFO|WARNING|ERROR|CRITICAL)",
        colour in any::<bool>(),
    ) {
        let (on, off) = if colour { ("\u{1b}[1;31m", "\u{1b}[0m") } else { ("", "") };
        let prefix = format!("({proc_} pid={pid}) {on}{level}{off} 11-29 18:21:33 [core.py:1510] ");
        let lines = split(format!("{prefix}EngineCore encountered a fatal error.\n{on}INFO{off}:     Application startup complete.\n").as_bytes());
        prop_assert_eq!(lines.len(), 2);
        let (fatal, ready) = VLLM.with(|c| {
            let mut c = c.borrow_mut();
            c.reset();
            let fatal = c.classify(lines[0].clone());
            c.reset();
            (fatal, c.classify(lines[1].clone()))
        });
        prop_assert_eq!(fatal.class, Class::Fatal);
        prop_assert_eq!(ready.class, Class::Ready);
    }
}
