//! Reading the files spex is handed, and writing the files it makes, without trusting either
//! path.
//!
//! Reading: every file read whole ([`read_capped`]) must be a regular file (a symlink to one is
//! fine), so a FIFO cannot block a load and `/dev/zero` cannot fill the memory, and is at most
//! the size its [`FileKind`] allows, checked from its metadata before a byte is read and again
//! while reading (a file that grows underneath stops at the cap).
//!
//! Writing: [`write_atomically`] writes to a temporary name beside the target and renames it
//! into place, so an interrupted write leaves the old file whole; [`create_unique`] opens a
//! file that did not exist before (`create_new`), numbering the name until one is free, so two
//! outputs made within one second never share a name; [`refuse_same_file`] keeps an output from
//! replacing one of the same command's inputs.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use super::error::{EngineError, Result};

/// What a file holds, which fixes the largest size spex reads of it whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    /// A JSON or TOML settings file: `config.json`, `tokenizer_config.json`, an index,
    /// models.toml, a training config or state.
    Settings,
    /// A `tokenizer.json` (the largest public ones hold a few tens of MB).
    Tokenizer,
    /// A recorded trace (`harness::trace`).
    Trace,
    /// A training corpus.
    Corpus,
}

const MIB: u64 = 1 << 20;

impl FileKind {
    /// The most bytes a file of this kind may hold.
    pub fn cap_bytes(self) -> u64 {
        match self {
            Self::Settings => 16 * MIB,
            Self::Tokenizer => 256 * MIB,
            Self::Trace => 2048 * MIB,
            Self::Corpus => 2048 * MIB,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Settings => "a settings file",
            Self::Tokenizer => "a tokenizer",
            Self::Trace => "a trace",
            Self::Corpus => "a training corpus",
        }
    }
}

/// What a path that is not a regular file is, for the error that refuses it.
fn special_kind(file_type: std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if file_type.is_fifo() {
            return "a FIFO";
        }
        if file_type.is_char_device() {
            return "a character device";
        }
        if file_type.is_block_device() {
            return "a block device";
        }
        if file_type.is_socket() {
            return "a socket";
        }
    }
    if file_type.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// Errors unless `path` (followed through symlinks) is a regular file of at most `kind`'s
/// size; returns its length.
pub fn check_readable(path: &Path, kind: FileKind) -> Result<u64> {
    let meta = std::fs::metadata(path).map_err(|e| EngineError::file(path, e))?;
    if !meta.is_file() {
        let what = special_kind(meta.file_type());
        return Err(EngineError::file(
            path,
            format!("{what}, not a regular file: spex reads only regular files"),
        ));
    }
    let cap = kind.cap_bytes();
    if meta.len() > cap {
        return Err(too_large(path, kind));
    }
    Ok(meta.len())
}

fn too_large(path: &Path, kind: FileKind) -> EngineError {
    EngineError::file(
        path,
        format!(
            "larger than {} holds (at most {} MB)",
            kind.name(),
            kind.cap_bytes() / MIB
        ),
    )
}

/// The bytes of the regular file `path`, of at most `kind`'s size.
pub fn read_capped(path: &Path, kind: FileKind) -> Result<Vec<u8>> {
    let len = check_readable(path, kind)?;
    let file = File::open(path).map_err(|e| EngineError::file(path, e))?;
    let cap = kind.cap_bytes();
    let mut bytes = Vec::with_capacity(len as usize);
    (file.take(cap + 1))
        .read_to_end(&mut bytes)
        .map_err(|e| EngineError::file(path, e))?;
    if bytes.len() as u64 > cap {
        return Err(too_large(path, kind));
    }
    Ok(bytes)
}

/// [`read_capped`] as UTF-8 text.
pub fn read_text(path: &Path, kind: FileKind) -> Result<String> {
    String::from_utf8(read_capped(path, kind)?).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        EngineError::file(
            path,
            format!("not UTF-8 text (invalid byte at offset {at})"),
        )
    })
}

/// A name beside `path` for writing it: hidden, unique to this process and this call.
fn temporary_name(path: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.{}-{n}.tmp", std::process::id()))
}

/// Writes `path` through `write` into a temporary file beside it, then renames that into
/// place: a reader sees the old file or the new one whole, never a part, and a failed or
/// interrupted write leaves the old file as it was (the temporary one is removed on error).
pub fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<()> {
    write_via_temporary(path, |temp| {
        let mut file = std::io::BufWriter::new(File::create(temp)?);
        write(&mut file)?;
        file.into_inner().map_err(|e| e.into_error())?.sync_all()
    })
}

/// [`write_atomically`] for a writer that takes a path (`safetensors` files): `write` fills
/// the temporary path it is given, which is then renamed to `path`.
pub fn write_via_temporary(
    path: &Path,
    write: impl FnOnce(&Path) -> std::io::Result<()>,
) -> Result<()> {
    let temp = temporary_name(path);
    let written = write(&temp).and_then(|()| std::fs::rename(&temp, path));
    written.map_err(|e| {
        let _ = std::fs::remove_file(&temp);
        EngineError::file(path, e)
    })
}

/// The `n`-th name of a series at `path` (from 1): `path` itself, then `NAME-2.EXT`,
/// `NAME-3.EXT`, … beside it.
pub fn numbered(path: &Path, n: usize) -> PathBuf {
    if n <= 1 {
        return path.to_path_buf();
    }
    let stem = path
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    let name = match path.extension() {
        Some(ext) => format!("{stem}-{n}.{}", ext.to_string_lossy()),
        None => format!("{stem}-{n}"),
    };
    path.with_file_name(name)
}

/// Creates a file that did not exist: `path`, or the first of `NAME-2.EXT`, `NAME-3.EXT`, …
/// ([`numbered`]) that is free. Creation is `create_new`, so two writers racing for one name
/// never share a file. Returns the file and the name it got.
pub fn create_unique(path: &Path) -> Result<(File, PathBuf)> {
    const MOST_TRIES: usize = 10_000;
    for n in 1..=MOST_TRIES {
        let candidate = numbered(path, n);
        match File::options()
            .write(true)
            .create_new(true)
            .open(&candidate)
        {
            Ok(file) => return Ok((file, candidate)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(EngineError::file(&candidate, e)),
        }
    }
    Err(EngineError::file(
        path,
        format!("{MOST_TRIES} files of this name already exist"),
    ))
}

/// Errors if `output` names the same file as `input` (through links and `..` alike), so
/// that a command never replaces what it reads; `flag` names the output's flag.
pub fn refuse_same_file(output: &Path, input: &Path, flag: &str) -> Result<()> {
    let same = match (std::fs::canonicalize(output), std::fs::canonicalize(input)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same {
        return Err(EngineError::file(
            output,
            format!("{flag} names the input file itself; choose another output path"),
        ));
    }
    Ok(())
}

/// Errors unless a file can be written at `path` (its folder exists and is writable, and
/// `path` is not a directory), checked before a long run rather than after it. Nothing is
/// left behind.
pub fn check_writable(path: &Path, flag: &str) -> Result<()> {
    if path.is_dir() {
        return Err(EngineError::file(path, format!("{flag}: is a directory")));
    }
    let probe = temporary_name(path);
    File::create(&probe)
        .map(drop)
        .map_err(|e| EngineError::file(path, format!("{flag}: cannot write here: {e}")))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_files_and_oversized_files_are_refused_before_reading() {
        let e = read_capped(Path::new("/dev/zero"), FileKind::Settings).unwrap_err();
        assert!(e.to_string().contains("a character device"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("config.json");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let e = read_capped(&link, FileKind::Settings).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let big = dir.path().join("big.json");
        let file = File::create(&big).unwrap();
        file.set_len(FileKind::Settings.cap_bytes() + 1).unwrap();
        let e = read_capped(&big, FileKind::Settings).unwrap_err();
        assert!(e.to_string().contains("at most 16 MB"), "{e}");
        let good = dir.path().join("good.json");
        std::fs::write(&good, "{}").unwrap();
        std::os::unix::fs::symlink(&good, dir.path().join("link.json")).unwrap();
        let text = read_text(&dir.path().join("link.json"), FileKind::Settings).unwrap();
        assert_eq!(text, "{}");
    }

    #[test]
    fn unique_names_never_collide_and_atomic_writes_replace_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spex.jsonl");
        let names: Vec<PathBuf> = (0..5).map(|_| create_unique(&path).unwrap().1).collect();
        let expected: Vec<PathBuf> = (1..=5).map(|n| numbered(&path, n)).collect();
        assert_eq!(names, expected);
        write_atomically(&path, |w: &mut dyn Write| w.write_all(b"new")).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        let failed = write_atomically(&path, |w: &mut dyn Write| {
            w.write_all(b"half")?;
            Err(std::io::Error::other("interrupted"))
        });
        assert!(failed.is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        let leftovers = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(leftovers, 5, "the temporary file is removed");
        assert!(refuse_same_file(&path, &dir.path().join("./spex.jsonl"), "--out").is_err());
        assert!(refuse_same_file(&numbered(&path, 2), &path, "--out").is_ok());
    }
}
