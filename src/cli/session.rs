//! Loading the model a command names: `--model` resolved through models.toml or the hub,
//! opened on the device and in the dtype asked for, with its draft model beside it where one
//! is named; and the [`Session`] the commands work from.

use super::{ModelArgs, device, load_bar, models};
use crate::engine::model::LoadOptions;
use crate::engine::policy::PolicyKind;
use crate::engine::{EngineError, LoadedModel, Sampling};

/// A loaded model with what the commands show about it.
#[derive(Debug, Clone)]
pub struct Session {
    pub loaded: LoadedModel,
    pub name: String,
    pub device: String,
    pub dtype: String,
    pub chat: bool,
    pub policy: Option<PolicyKind>,
    /// The entry's sampling defaults.
    pub sampling: Sampling,
    /// The prompt the dashboard opens with, ready to run.
    pub sample_prompt: String,
}

impl Session {
    /// The policy raced against baseline: `asked`, else the entry's when it speculates, else
    /// SPEED.
    pub fn speculative_policy(&self, asked: Option<PolicyKind>) -> PolicyKind {
        asked
            .or(self.policy.filter(|p| *p != PolicyKind::Baseline))
            .unwrap_or(PolicyKind::Speed)
    }

    /// The policies a bench races: those asked for, else the entry's speculative one.
    pub fn bench_policies(&self, asked: &[PolicyKind]) -> Vec<PolicyKind> {
        if asked.is_empty() {
            vec![self.speculative_policy(None)]
        } else {
            asked.to_vec()
        }
    }

    /// The prompt as the model sees it: wrapped in the checkpoint's chat template for chat
    /// models.
    pub fn prompt(&self, prompt: &str) -> Result<String, EngineError> {
        if self.chat {
            self.loaded.tokenizer.chat_prompt(prompt)
        } else {
            Ok(prompt.to_string())
        }
    }
}

/// Resolves and loads the model `args` name, on the device and dtype asked for, with a
/// progress bar on stderr while a large checkpoint loads; `policies` are those the command
/// was asked to run (empty: the entry's), which say whether its draft model is needed.
pub fn load_model(args: &ModelArgs, policies: &[PolicyKind]) -> Result<Session, EngineError> {
    let mut bar = load_bar::LoadBar::new(model_label(args));
    let session = load_model_with(args, policies, &mut |p| bar.show(p));
    bar.finish();
    session
}

/// How a load names the model: as `--model` gave it, or the default entry.
pub(super) fn model_label(args: &ModelArgs) -> String {
    args.model
        .clone()
        .unwrap_or_else(|| "the default model".into())
}

/// [`load_model`], telling `progress` how far the weights are read. The draft model is
/// loaded after the model, with the same settings, and attached to it: `--draft-model`
/// always, the entry's `draft` only where a `draft` policy will run (`policies`, else the
/// entry's), so that every other command starts without it.
pub fn load_model_with(
    args: &ModelArgs,
    policies: &[PolicyKind],
    progress: &mut dyn FnMut(crate::engine::checkpoint::LoadProgress),
) -> Result<Session, EngineError> {
    let (mut session, entry_draft) = load_one(args, progress)?;
    let is_draft = |p: &PolicyKind| matches!(p, PolicyKind::Draft { .. });
    let drafts = match policies {
        [] => session.policy.as_ref().is_some_and(is_draft),
        asked => asked.iter().any(is_draft),
    };
    if let Some(draft) = (args.draft_model.clone()).or(entry_draft.filter(|_| drafts)) {
        // The draft decodes on the model's threads (`LoadedModel::with_draft`): its own count
        // is the default, so that a capped `--threads` is noted once.
        let draft_args = ModelArgs {
            model: Some(draft),
            draft_model: None,
            threads: None,
            ..args.clone()
        };
        let (draft, _) = load_one(&draft_args, progress)?;
        session.loaded = session.loaded.with_draft(draft.loaded)?;
    }
    Ok(session)
}

/// Loads the one model `args.model` names; returns it with its entry's draft model's name.
fn load_one(
    args: &ModelArgs,
    progress: &mut dyn FnMut(crate::engine::checkpoint::LoadProgress),
) -> Result<(Session, Option<String>), EngineError> {
    let kernels = crate::engine::kernels::KernelOptions {
        isa: args.isa.isa()?,
        prefetch: args.prefetch.plan(),
        threads: Some(device::decode_threads(args.threads)?),
    };
    let resolved = resolve(args, progress)?;
    let entry = resolved.entry.as_ref();
    let spec = args
        .device
        .or(entry.and_then(|e| e.device))
        .unwrap_or(device::DeviceSpec::Auto);
    let dtype = match args.dtype.or(entry.and_then(|e| e.dtype)) {
        Some(d) => d.0,
        None => resolved.source.stored_dtype(),
    };
    let dev = device::open(spec)?;
    device::check_dtype(&dev, dtype)?;
    let chat = args.chat || entry.is_some_and(|e| e.chat);
    let options = LoadOptions {
        f32_proposals: args.f32_proposals,
        kv_dtype: args.kv_cache.into(),
        candle_ops: args.candle_ops,
        kernels,
    };
    let mut loaded = match &resolved.source {
        models::ModelSource::Dir(dir) => {
            LoadedModel::load_reporting(dir, &dev, dtype, options, progress)?
        }
        models::ModelSource::Embedded => {
            LoadedModel::from_bytes(models::EMBEDDED, &dev, dtype, options)?
        }
    };
    if chat {
        loaded.enable_chat_stop();
    }
    let draft = entry.and_then(|e| e.draft.clone());
    let session = Session {
        loaded,
        name: resolved.name,
        device: device::device_name(&dev),
        dtype: device::dtype_name(dtype).into(),
        chat,
        policy: entry.and_then(|e| e.policy),
        sample_prompt: entry
            .and_then(|e| e.prompt.clone())
            .unwrap_or_else(|| models::DEFAULT_SAMPLE_PROMPT.into()),
        sampling: entry_sampling(entry),
    };
    Ok((session, draft))
}

/// Where `args.model` is: an entry, a directory or the embedded model, pulled from the hub
/// first where it must be (its download reported to `progress`).
fn resolve(
    args: &ModelArgs,
    progress: &mut dyn FnMut(crate::engine::checkpoint::LoadProgress),
) -> Result<models::ResolvedModel, EngineError> {
    let mut hub_settings = crate::hub::HubSettings::from_env()?;
    hub_settings.offline |= args.offline;
    models::resolve(args.model.as_deref(), &hub_settings, &mut |p| {
        if let crate::hub::PullProgress::Downloading {
            done_bytes,
            total_bytes,
            ..
        } = p
        {
            progress(crate::engine::checkpoint::LoadProgress::Downloading {
                done_bytes,
                total_bytes,
            });
        }
    })
}

/// The sampling an entry sets, greedy where it sets none.
fn entry_sampling(entry: Option<&models::ModelEntry>) -> Sampling {
    Sampling {
        temperature: entry.and_then(|e| e.temperature).unwrap_or(0.0),
        top_k: entry.and_then(|e| e.top_k),
        top_p: entry.and_then(|e| e.top_p),
        seed: entry.and_then(|e| e.seed).unwrap_or(0),
    }
}
