//! Text ↔ token ids with a Hugging Face `tokenizer.json` (byte-level BPE, as Ouro ships), an
//! incremental detokenizer for streaming, and BPE training for spex's own models.

use std::path::Path;

use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer, TokenizerBuilder};

use super::chat::ChatTemplate;
use super::error::{EngineError, Result};

/// Special tokens in Ouro's order: `<|endoftext|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// A loaded tokenizer plus the ids that end generation.
#[derive(Debug, Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    eos: Vec<u32>,
    chat: ChatTemplate,
}

impl TextTokenizer {
    /// Loads `tokenizer.json`; `eos` comes from the model config.
    pub fn load(path: &Path, eos: &[u32]) -> Result<Self> {
        let bytes =
            crate::engine::files::read_capped(path, crate::engine::files::FileKind::Tokenizer)?;
        let inner = Tokenizer::from_bytes(bytes).map_err(|e| EngineError::file(path, e))?;
        Ok(Self {
            inner,
            eos: eos.to_vec(),
            chat: ChatTemplate::default(),
        })
    }

    /// Wraps an already loaded tokenizer.
    pub fn new(inner: Tokenizer, eos: &[u32]) -> Self {
        Self {
            inner,
            eos: eos.to_vec(),
            chat: ChatTemplate::default(),
        }
    }

    /// The same tokenizer with the checkpoint's chat template (ChatML until one is set).
    pub fn with_chat_template(self, chat: ChatTemplate) -> Self {
        Self { chat, ..self }
    }

    /// `prompt` as one user turn of the chat template, the assistant's turn begun.
    pub fn chat_prompt(&self, prompt: &str) -> Result<String> {
        self.chat.render(prompt)
    }

    /// Token ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?
            .get_ids()
            .to_vec())
    }

    /// The text of a sequence of ids.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).unwrap_or_default()
    }

    /// The text of one token on its own, for display (partial UTF-8 shows as U+FFFD).
    pub fn token_text(&self, id: u32) -> String {
        self.decode(&[id])
    }

    /// Tokens in the vocabulary, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Whether `other` gives every id the same token (special tokens included): what a draft
    /// model needs to draft in this tokenizer's ids.
    pub fn same_vocabulary(&self, other: &TextTokenizer) -> bool {
        self.inner.get_vocab(true) == other.inner.get_vocab(true)
    }

    /// Also ends generation at `<|im_end|>` (chat models end their turn with it).
    pub fn stop_at_end_of_turn(&mut self) {
        if let Some(id) = self.inner.token_to_id(SPECIAL_TOKENS[2])
            && !self.eos.contains(&id)
        {
            self.eos.push(id);
        }
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos.contains(&id)
    }
}

/// Streams text from committed ids, emitting only complete UTF-8 text (after candle's
/// `TokenOutputStream`): byte-level BPE splits multi-byte characters across tokens.
#[derive(Debug, Default, Clone)]
pub struct Detokenizer {
    ids: Vec<u32>,
    prev_index: usize,
    current_index: usize,
}

impl Detokenizer {
    /// Adds one id; returns the new text it completes, if any.
    pub fn push(&mut self, tokenizer: &TextTokenizer, id: u32) -> Option<String> {
        let prev_text = tokenizer.decode(&self.ids[self.prev_index..self.current_index]);
        self.ids.push(id);
        let text = tokenizer.decode(&self.ids[self.prev_index..]);
        if text.len() > prev_text.len() && !text.ends_with('\u{FFFD}') {
            let new = text.get(prev_text.len()..).unwrap_or_default().to_string();
            self.prev_index = self.current_index;
            self.current_index = self.ids.len();
            Some(new)
        } else {
            None
        }
    }

    /// The text of the ids no `push` has returned yet, as the full decode shows it: where the
    /// output ends inside a multi-byte character, that is U+FFFD (as HF tokenizers and the
    /// finish event's text show it). Streamed deltas plus this tail equal the whole decode.
    pub fn finish(&mut self, tokenizer: &TextTokenizer) -> String {
        let prev_text = tokenizer.decode(&self.ids[self.prev_index..self.current_index]);
        let text = tokenizer.decode(&self.ids[self.prev_index..]);
        self.prev_index = self.current_index;
        self.current_index = self.ids.len();
        text.get(prev_text.len()..).unwrap_or_default().to_string()
    }
}

/// Trains a byte-level BPE tokenizer of about `vocab_size` tokens on `texts` and writes it as
/// `tokenizer.json` at `out`. Ouro's three special tokens take ids 0, 1, 2.
pub fn train_bpe<I, S>(texts: I, vocab_size: usize, out: &Path) -> Result<()>
where
    I: Iterator<Item = S> + Send,
    S: AsRef<str> + Send,
{
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(
            SPECIAL_TOKENS
                .iter()
                .map(|t| AddedToken::from(*t, true))
                .collect(),
        )
        .build();
    let mut tokenizer =
        TokenizerBuilder::<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevel>::new()
            .with_model(BPE::default())
            .with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
            .with_decoder(Some(ByteLevel::default()))
            .build()
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
    tokenizer
        .train(&mut trainer, texts)
        .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
    tokenizer
        .save(out, false)
        .map_err(|e| EngineError::file(out, e))?;
    Ok(())
}
