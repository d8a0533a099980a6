//! `App::update` under keys: random keys, resizes and engine events never panic, and every
//! key the help lists acts, and every key that acts is listed. Part of the `tui_app` test
//! binary, whose helpers it uses.

use super::*;

#[test]
fn random_keys_resizes_and_events_never_panic() {
    let events = race_events("To be");
    let mut rng = SplitMix(42);
    let codes = [
        KeyCode::Char(' '),
        KeyCode::Char('n'),
        KeyCode::Char('+'),
        KeyCode::Char('-'),
        KeyCode::Char('r'),
        KeyCode::Char('e'),
        KeyCode::Char('?'),
        KeyCode::Char('x'),
        KeyCode::Char('é'),
        KeyCode::Tab,
        KeyCode::Up,
        KeyCode::Down,
        KeyCode::PageUp,
        KeyCode::PageDown,
        KeyCode::Enter,
        KeyCode::Esc,
        KeyCode::Backspace,
        KeyCode::Delete,
        KeyCode::Left,
        KeyCode::Right,
        KeyCode::Home,
        KeyCode::End,
    ];
    let backend = ratatui::backend::TestBackend::new(120, 40);
    let mut terminal = ratatui::Terminal::new(backend).unwrap();
    let mut app = App::new(info(), Some("To be".into()), (120, 40));
    app.start();
    let mut next_event = 0;
    for i in 0..5000 {
        let msg = match rng.next_u64() % 10 {
            0 => Msg::Resize((rng.next_u64() % 200) as u16, (rng.next_u64() % 80) as u16),
            1 | 2 => {
                let n = (rng.next_u64() % 8) as usize;
                let batch: Vec<RaceEvent> = events
                    .iter()
                    .cycle()
                    .skip(next_event)
                    .take(n)
                    .cloned()
                    .collect();
                next_event = (next_event + n) % events.len();
                Msg::Engine(batch)
            }
            _ => key(codes[(rng.next_u64() % codes.len() as u64) as usize]),
        };
        app.update(msg);
        if i % 50 == 0 {
            let (w, h) = (app.size.0.max(1), app.size.1.max(1));
            terminal.backend_mut().resize(w, h);
            terminal
                .resize(ratatui::layout::Rect::new(0, 0, w, h))
                .unwrap();
            terminal.draw(|f| spex::tui::ui::draw(f, &app)).unwrap();
        }
    }
}

/// What a key changed in the panes: the commands it returned and the state keys steer.
/// Everything a key can change: the commands, focus, help, pause, rate, quitting, scrolling,
/// the error line (keys that need a replay say so there), the inspector's cursor,
/// presenter mode and the explorer's cursor.
type Effect = (
    Vec<Command>,
    Focus,
    bool,
    bool,
    usize,
    bool,
    u16,
    Option<String>,
    Option<usize>,
    bool,
    Option<spex::tui::explorer::ExplorerCursor>,
);

fn key_effect(code: KeyCode) -> Effect {
    let mut app = running_app();
    // Scrolled a little, so that scrolling either way shows.
    app.run.as_mut().expect("a run").speculative.scroll = 20;
    // Some output, so that the inspector's keys have tokens to move over.
    app.run.as_mut().expect("a run").speculative.tokens = vec![1, 2, 3];
    let commands = app.update(key(code));
    let scroll = app.run.as_ref().map_or(0, |r| r.speculative.scroll);
    (
        commands,
        app.focus,
        app.show_help,
        app.paused,
        app.rate_index,
        app.should_quit,
        scroll,
        app.error.clone(),
        app.inspect,
        app.present,
        app.explorer,
    )
}

#[test]
fn every_bound_key_is_listed_and_every_key_that_acts_is_bound() {
    use spex::tui::keymap::{self, BINDINGS, Mode};
    for binding in BINDINGS {
        for (k, _) in binding.keys.iter().filter(|(k, _)| k.listed) {
            let name = keymap::key_name(k);
            assert!(
                binding.label.contains(&name),
                "{name} is missing from {:?}",
                binding.label
            );
        }
    }
    let nothing = key_effect(KeyCode::Null);
    let mut codes: Vec<KeyCode> = (' '..='~').map(KeyCode::Char).collect();
    codes.extend([
        KeyCode::Enter,
        KeyCode::Esc,
        KeyCode::Tab,
        KeyCode::BackTab,
        KeyCode::Backspace,
        KeyCode::Delete,
        KeyCode::Insert,
        KeyCode::Home,
        KeyCode::End,
        KeyCode::Left,
        KeyCode::Right,
        KeyCode::Up,
        KeyCode::Down,
        KeyCode::PageUp,
        KeyCode::PageDown,
    ]);
    codes.extend((1..=12).map(KeyCode::F));
    for code in codes {
        let bound = keymap::action(Mode::Panes, KeyEvent::new(code, KeyModifiers::NONE));
        let acts = key_effect(code) != nothing;
        assert_eq!(
            acts,
            bound.is_some(),
            "{code:?}: acts {acts}, bound {bound:?}"
        );
    }
}
