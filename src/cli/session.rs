//! Loading the model a command names: `--model` resolved through models.toml or the hub,
//! opened on the device and in the dtype asked for, with its draft model beside it where one
//! is named; and the [`Session`] the commands work from.

use super::{ModelArgs, device, load_bar, models};
use crate::engine::checkpoint::{LoadPlan, LoadProgress, ModelFiles};
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

/// [`load_model`], telling `progress` how far the weights are read. Both names are resolved
/// first, then one [`LoadPlan`] loads the model and its draft model on one device: the draft
/// is `--draft-model` always, the entry's `draft` only where a `draft` policy will run
/// (`policies`, else the entry's), so that every other command starts without it.
pub fn load_model_with(
    args: &ModelArgs,
    policies: &[PolicyKind],
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<Session, EngineError> {
    let kernels = crate::engine::kernels::KernelOptions {
        isa: args.isa.isa()?,
        prefetch: args.prefetch.plan(),
        threads: Some(device::decode_threads(args.threads)?),
    };
    let resolved = resolve(args.model.as_deref(), args, progress)?;
    let entry = resolved.entry.as_ref();
    let is_draft = |p: &PolicyKind| matches!(p, PolicyKind::Draft { .. });
    let drafts = match policies {
        [] => entry.and_then(|e| e.policy).as_ref().is_some_and(is_draft),
        asked => asked.iter().any(is_draft),
    };
    let entry_draft = entry.and_then(|e| e.draft.clone()).filter(|_| drafts);
    let draft = match args.draft_model.clone().or(entry_draft) {
        Some(name) => Some(resolve(Some(&name), args, progress)?),
        None => None,
    };
    let spec = (args.device)
        .or(entry.and_then(|e| e.device))
        .unwrap_or(device::DeviceSpec::Auto);
    let dev = device::open(spec)?;
    let plan = LoadPlan {
        model: model_files(args, &resolved, &dev)?,
        draft: draft.map(|d| model_files(args, &d, &dev)).transpose()?,
        options: LoadOptions {
            f32_proposals: args.f32_proposals,
            kv_dtype: args.kv_cache.into(),
            candle_ops: args.candle_ops,
            kernels,
        },
    };
    let loaded = LoadedModel::open(&plan, &dev, progress)?;
    // The weights as stored (`Q8_0`, `bf16`); a model widened on a GPU shows its dtype.
    let dtype = match &loaded.backend {
        crate::engine::model::Backend::Host(_) => loaded.model().weight_type(),
        _ => device::dtype_name(plan.model.dtype).into(),
    };
    Ok(Session {
        loaded,
        name: resolved.name,
        device: device::device_name(&dev),
        dtype,
        chat: plan.model.chat_stop,
        policy: entry.and_then(|e| e.policy),
        sample_prompt: entry
            .and_then(|e| e.prompt.clone())
            .unwrap_or_else(|| models::DEFAULT_SAMPLE_PROMPT.into()),
        sampling: entry_sampling(entry),
    })
}

/// How one resolved model loads: in `--dtype`, else its entry's, else the stored one (which
/// `device` must support), stopping at the chat end-of-turn where `--chat` or its entry asks.
fn model_files(
    args: &ModelArgs,
    resolved: &models::ResolvedModel,
    device: &candle_core::Device,
) -> Result<ModelFiles, EngineError> {
    let entry = resolved.entry.as_ref();
    let dtype = match args.dtype.or(entry.and_then(|e| e.dtype)) {
        Some(d) => d.0,
        None => resolved.source.stored_dtype(),
    };
    device::check_dtype(device, dtype)?;
    Ok(ModelFiles {
        origin: resolved.source.clone(),
        dtype,
        chat_stop: args.chat || entry.is_some_and(|e| e.chat),
    })
}

/// Where `model` is (`None`: the default entry): an entry, a directory or the embedded model,
/// pulled from the hub first where it must be (its download reported to `progress`).
fn resolve(
    model: Option<&str>,
    args: &ModelArgs,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<models::ResolvedModel, EngineError> {
    let mut hub_settings = crate::hub::HubSettings::from_env()?;
    hub_settings.offline |= args.offline;
    models::resolve(model, &hub_settings, &mut |p| {
        if let crate::hub::PullProgress::Downloading {
            done_bytes,
            total_bytes,
            ..
        } = p
        {
            progress(LoadProgress::Downloading {
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
