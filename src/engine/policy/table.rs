//! The one table of the policies a user can name ([`POLICIES`]): each row's name, how it is
//! written, what it does and how its parameters parse. Parsing ([`PolicyKind`]'s `FromStr`),
//! the list an unknown name's error gives, the CLI's help ([`help`]) and the bench's refusal
//! of a lane that does not speculate all read it, so a new policy is its own file (its
//! `Policy` type and its parameters' parser), one `PolicyKind` variant and one row here.

use super::{PolicyKind, draft_model, loopspec, self_draft};

/// One policy a user can name.
#[derive(Debug, Clone, Copy)]
pub struct PolicyRow {
    /// The name before any `:`.
    pub name: &'static str,
    /// The ways it is written, parameters in brackets where they are optional.
    pub forms: &'static [&'static str],
    /// What it does, in a few words (the CLI's help).
    pub summary: &'static str,
    /// Whether it races against the baseline as a speculative lane.
    pub speculative: bool,
    /// The policy its parameters (what follows `name:`, or "" when written alone) make.
    parse: fn(&str) -> Result<PolicyKind, String>,
}

/// Every policy a user can name, in the order the help lists them.
pub const POLICIES: [PolicyRow; 6] = [
    PolicyRow {
        name: "speed",
        forms: &["speed"],
        summary: "SPEED: each token starts from the one before's pass-1 prediction",
        speculative: true,
        parse: speed,
    },
    PolicyRow {
        name: "dual",
        forms: &["dual[:MARGIN]"],
        summary: "SPEED with a gated second proposal; MARGIN sets the gate in logits",
        speculative: true,
        parse: dual,
    },
    PolicyRow {
        name: "loopspec",
        forms: &["loopspec[:d1=N][:d2=M]"],
        summary: "LoopSpec's proposals at depth N, gated second ones at M, verified by \
                  rejection sampling",
        speculative: true,
        parse: loopspec,
    },
    PolicyRow {
        name: "self-draft",
        forms: &["self-draft[:d=N][:g=M]"],
        summary: "draft then verify: M tokens drafted from pass N, then verified together",
        speculative: true,
        parse: self_draft,
    },
    PolicyRow {
        name: "draft",
        forms: &["draft[:g=M]"],
        summary: "draft then verify with M tokens from --draft-model",
        speculative: true,
        parse: draft,
    },
    PolicyRow {
        name: "baseline",
        forms: &["baseline"],
        summary: "one token at a time, every pass: what the others are held to",
        speculative: false,
        parse: baseline,
    },
];

/// The forms of the rows `which` keeps, as a list: `a, b, c or d`.
pub fn forms(which: impl Fn(&PolicyRow) -> bool) -> String {
    let all: Vec<&str> = (POLICIES.iter())
        .filter(|row| which(row))
        .flat_map(|row| row.forms.iter().copied())
        .collect();
    match all.split_last() {
        Some((last, [])) => last.to_string(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// The CLI's help for a policy flag: `intro`, then every policy (the speculative ones unless
/// `baseline`) with what it does, then the default.
pub fn help(intro: &str, baseline: bool) -> String {
    let listed: Vec<String> = (POLICIES.iter())
        .filter(|row| baseline || row.speculative)
        .map(|row| format!("{} ({})", row.forms.join(", "), row.summary))
        .collect();
    format!(
        "{intro}: {} (default: the entry's, else speed)",
        listed.join("; ")
    )
}

/// Parses `s`: a row's name alone, or `name:parameters`.
pub(super) fn parse(s: &str) -> Result<PolicyKind, String> {
    let (name, params) = s.split_once(':').unwrap_or((s, ""));
    if s.ends_with(':') {
        return Err(format!(
            "policy `{s}`: nothing after `:` (write `{name}` alone, or give its parameters)"
        ));
    }
    let unknown = || format!("unknown policy `{s}` (expected {})", forms(|_| true));
    let row = POLICIES
        .iter()
        .find(|row| row.name == name)
        .ok_or_else(unknown)?;
    (row.parse)(params).map_err(|e| match e.is_empty() {
        true => unknown(),
        false => format!("policy `{s}`: {e}"),
    })
}

/// `kind` where it is written alone; given parameters it does not take, an empty error,
/// which [`parse`] reports as an unknown policy with the list of forms.
fn none_taken(params: &str, kind: PolicyKind) -> Result<PolicyKind, String> {
    match params.is_empty() {
        true => Ok(kind),
        false => Err(String::new()),
    }
}

fn speed(params: &str) -> Result<PolicyKind, String> {
    none_taken(params, PolicyKind::Speed)
}

fn baseline(params: &str) -> Result<PolicyKind, String> {
    none_taken(params, PolicyKind::Baseline)
}

fn dual(params: &str) -> Result<PolicyKind, String> {
    if params.is_empty() {
        return Ok(PolicyKind::DUAL);
    }
    match params.parse::<f32>() {
        Ok(m) if m.is_finite() && m > 0.0 => Ok(PolicyKind::Dual { margin_below: m }),
        _ => Err("the dual margin must be a positive number of logits".into()),
    }
}

fn loopspec(params: &str) -> Result<PolicyKind, String> {
    loopspec::parse_depths(params).map(|(d1, d2)| PolicyKind::LoopSpec { d1, d2 })
}

fn self_draft(params: &str) -> Result<PolicyKind, String> {
    self_draft::parse_drafting(params)
        .map(|(depth, tokens)| PolicyKind::SelfDraft { depth, tokens })
}

fn draft(params: &str) -> Result<PolicyKind, String> {
    draft_model::parse_tokens(params).map(|tokens| PolicyKind::Draft { tokens })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every form a row lists parses to a policy of that row, and the policy's name reads
    /// back; the list an unknown name gives names every form.
    #[test]
    fn every_row_parses_its_forms_and_the_list_names_them_all() {
        for row in POLICIES {
            let written = row.forms[0].split('[').next().unwrap_or(row.name);
            let kind = parse(written).unwrap();
            assert_eq!(kind.to_string(), written, "{}", row.name);
            assert_eq!(
                kind != PolicyKind::Baseline,
                row.speculative,
                "{}",
                row.name
            );
        }
        assert_eq!(
            forms(|_| true),
            "speed, dual[:MARGIN], loopspec[:d1=N][:d2=M], self-draft[:d=N][:g=M], draft[:g=M] \
             or baseline"
        );
        assert!(
            parse("speed:x")
                .unwrap_err()
                .starts_with("unknown policy `speed:x`")
        );
        let raced = help("Raced", false);
        assert!(
            raced.contains("loopspec[:d1=N][:d2=M] (LoopSpec's") && !raced.contains("baseline (")
        );
        assert!(help("The policy", true).contains("; baseline (one token at a time"));
    }
}
