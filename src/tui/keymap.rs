//! The dashboard's keys in one table: `App::on_key` looks keys up here and the help overlay
//! lists the table, so what a key does and what `?` says it does cannot disagree.

use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};

/// What a key asks the dashboard to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Quit,
    Help,
    TogglePause,
    SingleStep,
    Faster,
    Slower,
    Rerun,
    EditPrompt,
    NextFocus,
    ScrollUp,
    ScrollDown,
    PageUp,
    PageDown,
    /// Temperature one step up, then rerun.
    Hotter,
    /// Temperature one step down, then rerun.
    Cooler,
    /// A new sampling seed, then rerun.
    NewSeed,
    /// Replay: one step back.
    StepBack,
    /// One step forward (live: as `n`).
    StepForward,
    /// Replay: back to the start.
    ToStart,
    /// Replay: on to the end.
    ToEnd,
    /// Start or stop recording the run to a trace.
    ToggleRecording,
    /// Open or close the token inspector.
    Inspect,
    /// Presenter mode on / off.
    TogglePresenter,
    /// Open or close the misprediction explorer.
    Explore,
    /// Explorer: the previous / next pair.
    ExplorePrevious,
    ExploreNext,
    /// Explorer: the replay to the selected pair's next occurrence.
    GoToOccurrence,
    /// Inspector: the previous / next token.
    InspectPrevious,
    InspectNext,
    /// In the prompt editor: run the prompt.
    RunPrompt,
    /// In the prompt editor: move focus away from it.
    LeavePrompt,
}

/// Where a binding applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Everywhere, the help overlay and the prompt editor included.
    Always,
    /// The panes, outside the prompt editor.
    Panes,
    /// The prompt editor (other keys type).
    Prompt,
    /// Not a key: shown in the help only (the mouse wheel; any key closing the help).
    Shown,
}

/// A key, with or without Ctrl, and whether the help names it (an alias such as `=` for `+`
/// is bound but not listed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    pub code: KeyCode,
    pub ctrl: bool,
    pub listed: bool,
}

const fn key(c: char) -> Key {
    Key {
        code: KeyCode::Char(c),
        ctrl: false,
        listed: true,
    }
}

const fn alias(c: char) -> Key {
    Key {
        listed: false,
        ..key(c)
    }
}

const fn special(code: KeyCode) -> Key {
    Key {
        code,
        ctrl: false,
        listed: true,
    }
}

const fn unlisted(code: KeyCode) -> Key {
    Key {
        listed: false,
        ..special(code)
    }
}

/// One line of the help overlay: how it names the keys, what they do, and the keys.
#[derive(Debug, Clone, Copy)]
pub struct Binding {
    pub label: &'static str,
    pub help: &'static str,
    pub mode: Mode,
    pub keys: &'static [(Key, Action)],
}

const fn line(
    label: &'static str,
    help: &'static str,
    mode: Mode,
    keys: &'static [(Key, Action)],
) -> Binding {
    Binding {
        label,
        help,
        mode,
        keys,
    }
}

/// Every key, in the order the help lists them.
pub const BINDINGS: [Binding; 20] = [
    line(
        "Enter",
        "run the prompt",
        Mode::Always,
        &[(special(KeyCode::Enter), Action::RunPrompt)],
    ),
    line(
        "e",
        "edit the prompt",
        Mode::Panes,
        &[(key('e'), Action::EditPrompt)],
    ),
    line(
        "Space",
        "pause / resume",
        Mode::Panes,
        &[(key(' '), Action::TogglePause)],
    ),
    line(
        "n",
        "single step (pauses)",
        Mode::Panes,
        &[(key('n'), Action::SingleStep)],
    ),
    line(
        "← → Home End",
        "replay: a step back / forward, to the start / the end",
        Mode::Panes,
        &[
            (special(KeyCode::Left), Action::StepBack),
            (special(KeyCode::Right), Action::StepForward),
            (special(KeyCode::Home), Action::ToStart),
            (special(KeyCode::End), Action::ToEnd),
        ],
    ),
    line(
        "+ / -",
        "more / fewer steps per second (down to 1)",
        Mode::Panes,
        &[
            (key('+'), Action::Faster),
            (alias('='), Action::Faster),
            (key('-'), Action::Slower),
            (alias('_'), Action::Slower),
        ],
    ),
    line(
        "r",
        "rerun the prompt",
        Mode::Panes,
        &[(key('r'), Action::Rerun)],
    ),
    line(
        "t / T",
        "temperature up / down (0 is greedy), then rerun",
        Mode::Panes,
        &[(key('t'), Action::Hotter), (key('T'), Action::Cooler)],
    ),
    line(
        "s",
        "new sampling seed, then rerun",
        Mode::Panes,
        &[(key('s'), Action::NewSeed)],
    ),
    line(
        "i [ ]",
        "token inspector: open / close, previous / next token",
        Mode::Panes,
        &[
            (key('i'), Action::Inspect),
            (key('['), Action::InspectPrevious),
            (key(']'), Action::InspectNext),
        ],
    ),
    line(
        "x { } g",
        "explorer: open / close, pick a pair, go to it",
        Mode::Panes,
        &[
            (key('x'), Action::Explore),
            (key('{'), Action::ExplorePrevious),
            (key('}'), Action::ExploreNext),
            (key('g'), Action::GoToOccurrence),
        ],
    ),
    line(
        "w",
        "record the run to a trace (spex-SECONDS.jsonl) / stop",
        Mode::Panes,
        &[(key('w'), Action::ToggleRecording)],
    ),
    line(
        "p",
        "presenter mode on / off (for talks)",
        Mode::Panes,
        &[(key('p'), Action::TogglePresenter)],
    ),
    line(
        "Tab",
        "move focus: prompt, SPEED, baseline, flips",
        Mode::Panes,
        &[(special(KeyCode::Tab), Action::NextFocus)],
    ),
    line(
        "↑ ↓ PgUp PgDn",
        "scroll the focused text",
        Mode::Panes,
        &[
            (special(KeyCode::Up), Action::ScrollUp),
            (special(KeyCode::Down), Action::ScrollDown),
            (special(KeyCode::PageUp), Action::PageUp),
            (special(KeyCode::PageDown), Action::PageDown),
        ],
    ),
    line("mouse wheel", "scroll the focused text", Mode::Shown, &[]),
    line("?", "this help", Mode::Panes, &[(key('?'), Action::Help)]),
    line(
        "Esc",
        "leave the prompt / close help",
        Mode::Prompt,
        &[
            (special(KeyCode::Esc), Action::LeavePrompt),
            (unlisted(KeyCode::Tab), Action::LeavePrompt),
        ],
    ),
    line("q", "quit", Mode::Panes, &[(key('q'), Action::Quit)]),
    line(
        "Ctrl-C",
        "quit",
        Mode::Always,
        &[(
            Key {
                code: KeyCode::Char('c'),
                ctrl: true,
                listed: true,
            },
            Action::Quit,
        )],
    ),
];

/// The action `key` is bound to in `mode`, bindings for every mode included. A Ctrl binding
/// needs Ctrl; the others ignore modifiers (Shift comes with `+` and `?` on most layouts).
pub fn action(mode: Mode, key: KeyEvent) -> Option<Action> {
    let ctrl = key.modifiers.contains(KeyModifiers::CONTROL);
    BINDINGS
        .iter()
        .filter(|b| b.mode == Mode::Always || b.mode == mode)
        .flat_map(|b| b.keys)
        .find(|(k, _)| k.code == key.code && (ctrl || !k.ctrl))
        .map(|&(_, action)| action)
}

/// How the help names `key`, for the check that every listed key appears in its line.
pub fn key_name(key: &Key) -> String {
    let name = match key.code {
        KeyCode::Char(' ') => "Space".to_string(),
        KeyCode::Char(c) => c.to_string(),
        KeyCode::Up => "↑".into(),
        KeyCode::Down => "↓".into(),
        KeyCode::Left => "←".into(),
        KeyCode::Right => "→".into(),
        KeyCode::PageUp => "PgUp".into(),
        KeyCode::PageDown => "PgDn".into(),
        other => format!("{other:?}"),
    };
    if key.ctrl {
        format!("Ctrl-{}", name.to_uppercase())
    } else {
        name
    }
}
