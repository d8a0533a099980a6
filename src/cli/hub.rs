//! `spex pull`: downloads a models.toml entry or an ORG/NAME repo into the local hub cache
//! (`crate::hub::pull`), with a bar per file on stderr (bytes, rate, and the retry under
//! way), then prints the snapshot and the commit the revision named, to pin it.

use indicatif::ProgressBar;

use super::load_bar::bytes_style;
use super::models;
use crate::hub::{self, HubSettings, PullFiles, PullProgress};

/// Where `name` is pulled from: a repo, a revision and the one file wanted, if any.
struct Source {
    repo: String,
    revision: String,
    file: Option<String>,
}

/// Where `name` is pulled from, `revision` and `file` overriding its entry's.
fn source(name: &str, revision: Option<&str>, file: Option<&str>) -> anyhow::Result<Source> {
    let models_file = models::models_file_path();
    let entry = match models_file.is_file() {
        true => models::ModelsFile::load(&models_file)?.models.remove(name),
        false => None,
    };
    let (repo, pinned, entry_file) = match entry {
        Some(models::ModelEntry {
            repo: Some(repo),
            revision,
            file,
            ..
        }) => (repo, revision, file),
        Some(_) => anyhow::bail!("`{name}` is a local model: nothing to pull"),
        None if hub::is_repo_id(name) => (name.to_string(), None, None),
        None => anyhow::bail!("no model entry `{name}` in {}", models_file.display()),
    };
    let revision = revision.map(str::to_string).or(pinned);
    Ok(Source {
        repo,
        revision: revision.unwrap_or_else(|| "main".into()),
        file: file.map(str::to_string).or(entry_file),
    })
}

/// Runs `spex pull NAME [--revision REV] [--file FILE]`.
pub fn run(name: &str, revision: Option<&str>, file: Option<&str>) -> anyhow::Result<()> {
    let Source {
        repo,
        revision,
        file,
    } = source(name, revision, file)?;
    let settings = HubSettings::from_env()?;
    let files = file
        .as_deref()
        .map_or(PullFiles::Checkpoint, PullFiles::File);
    let mut bar = PullBar::default();
    let pulled = hub::pull(&settings, &repo, &revision, files, &mut |p| bar.show(p));
    bar.finish();
    let pulled = pulled?;
    let what = match name == repo {
        true => format!("{repo}@{revision}"),
        false => format!("{name}: {repo}@{revision}"),
    };
    println!(
        "{what} is commit {} ({:.1} MB, {:.1} MB downloaded)",
        pulled.commit,
        hub::snapshot_size(&pulled.snapshot) as f64 / 1e6,
        pulled.downloaded_bytes as f64 / 1e6
    );
    match &file {
        Some(file) => println!("  {}", pulled.snapshot.join(file).display()),
        None => println!("  {}", pulled.snapshot.display()),
    }
    if !hub::is_commit(&revision) {
        println!(
            "  to pin it, set `revision = \"{}\"` in the models.toml entry",
            pulled.commit
        );
    }
    Ok(())
}

/// The retry's reason is cut to this, to keep the bar on one line.
const REASON_CHARS: usize = 40;

/// Files smaller than this arrive at once: no bar.
const SHOWN_FROM_BYTES: u64 = 1 << 20;

/// One bar for the file downloading now, for files large enough to wait for; indicatif
/// draws nothing where stderr is not a terminal.
#[derive(Default)]
pub struct PullBar {
    bar: Option<(String, ProgressBar)>,
}

impl PullBar {
    /// Shows `progress`.
    pub fn show(&mut self, progress: PullProgress) {
        match progress {
            PullProgress::Downloading {
                file,
                done_bytes,
                total_bytes,
            } if total_bytes >= SHOWN_FROM_BYTES => {
                let bar = self.bar_for(file, total_bytes);
                bar.set_message("");
                bar.set_position(done_bytes);
            }
            PullProgress::Retrying {
                file,
                attempt,
                max_attempts,
                reason,
            } => {
                let bar = self.bar_for(file, 0);
                let reason: String = reason.chars().take(REASON_CHARS).collect();
                bar.set_message(format!("retry {attempt}/{max_attempts}: {reason}"));
            }
            PullProgress::Downloading { .. } => {}
            PullProgress::Done { .. } => self.finish(),
        }
    }

    fn bar_for(&mut self, file: &str, total_bytes: u64) -> &ProgressBar {
        if self.bar.as_ref().is_some_and(|(f, _)| f != file) {
            self.finish();
        }
        let (_, bar) = self.bar.get_or_insert_with(|| {
            let bar = ProgressBar::new(total_bytes);
            bar.set_style(bytes_style());
            bar.set_prefix(file.to_string());
            (file.to_string(), bar)
        });
        if total_bytes > 0 {
            bar.set_length(total_bytes);
        }
        bar
    }

    /// Leaves the finished file's bar on screen.
    pub fn finish(&mut self) {
        if let Some((_, bar)) = self.bar.take() {
            bar.finish();
        }
    }
}
