package sink

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go/jetstream"
)

// EnsureStream creates the stream when it is missing (subjects "<prefix>.>",
// limits retention, the StreamSpec's replicas, limits, storage and discard,
// the configured duplicate window, atomic publish allowed with
// ExactlyOnceAtomic) and otherwise checks that the existing stream captures
// "<prefix>.>" (and allows atomic publish when needed); it never changes an
// existing stream, and logs a warning with the `nats stream edit` line when
// it differs from the settings given (Drift).
func (p *Publisher) EnsureStream(ctx context.Context) (*jetstream.StreamInfo, error) {
	want := p.cfg.SubjectPrefix + ".>"
	s, err := p.js.Stream(ctx, p.cfg.Stream)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		subjects := []string{want}
		if dl := p.cfg.DeadLetterSubject + ".>"; p.cfg.DeadLetterSubject != "" && !Captures(subjects, dl) {
			subjects = append(subjects, dl)
		}
		cfg, why := p.streamConfig(subjects)
		s, err = p.js.CreateStream(ctx, cfg)
		if err != nil {
			return nil, fmt.Errorf("create stream %q with subjects %q: %w", p.cfg.Stream, want, p.createError(err, cfg, why))
		}
		p.log.Info().Strs("subjects", subjects).Int("replicas", cfg.Replicas).Str("replicas_from", why).
			Dur("max_age", cfg.MaxAge).Int64("max_bytes", cfg.MaxBytes).Int64("max_msgs", cfg.MaxMsgs).
			Str("storage", StorageText(cfg.Storage)).Str("discard", DiscardText(cfg.Discard)).
			Dur("duplicate_window", cfg.Duplicates).Bool("allow_atomic", p.cfg.Delivery.Atomic()).Msg("created stream")
	case err != nil:
		return nil, fmt.Errorf("look up stream %q: %w", p.cfg.Stream, err)
	default:
		c := s.CachedInfo().Config
		if d := p.Drift(c); len(d) > 0 {
			p.log.Warn().Str("fix", p.DriftFix(d)).Msg(DriftText(p.cfg.Stream, d))
		}
		if w := p.cfg.DuplicateWindow; !p.cfg.Delivery.ExactlyOnce() && !p.cfg.StreamSpec.Given["duplicate-window"] && c.Duplicates < w {
			// Dedup mode on a stream made for exactly-once (1s window), or
			// by hand: Drift compares only the flags given.
			p.log.Warn().Str("fix", fmt.Sprintf("nats stream edit %s --dupe-window %s", p.cfg.Stream, w)).
				Msgf("stream %q has a duplicate window of %s, shorter than the %s dedup mode relies on (--max-outage): a replay after a longer outage stores copies", p.cfg.Stream, c.Duplicates, w)
		}
	}
	info := s.CachedInfo()
	if !Captures(info.Config.Subjects, want) {
		return info, fmt.Errorf("stream %q has subjects %q, which do not capture %q: add %q to the stream's subjects, or set --subject-prefix / --stream to match",
			p.cfg.Stream, info.Config.Subjects, want, want)
	}
	if dl := p.cfg.DeadLetterSubject + ".>"; p.cfg.DeadLetterSubject != "" && !Captures(info.Config.Subjects, dl) {
		return info, fmt.Errorf("stream %q has subjects %q, which do not capture the dead letters %q: add %q to the stream's subjects, or change --dead-letter-subject",
			p.cfg.Stream, info.Config.Subjects, dl, dl)
	}
	if p.cfg.Delivery.Atomic() {
		if err := p.atomicSupport(info.Config.AllowAtomicPublish); err != nil {
			return info, err
		}
	}
	return info, nil
}

// MessageLimit returns the largest message the server and the stream take:
// the server's max_payload, or the stream's max_msg_size when smaller.
func (p *Publisher) MessageLimit(ctx context.Context) (int, error) {
	limit := int(p.nc.MaxPayload())
	s, err := p.js.Stream(ctx, p.cfg.Stream)
	if err != nil {
		return 0, fmt.Errorf("look up stream %q: %w", p.cfg.Stream, err)
	}
	if m := int(s.CachedInfo().Config.MaxMsgSize); m > 0 && m < limit {
		limit = m
	}
	return limit, nil
}

// Captures reports whether some subject filter in filters matches every
// subject that pattern matches (NATS wildcard rules: '*' one token, '>' the rest).
func Captures(filters []string, pattern string) bool {
	pt := strings.Split(pattern, ".")
	for _, f := range filters {
		if covers(strings.Split(f, "."), pt) {
			return true
		}
	}
	return false
}

func covers(f, p []string) bool {
	for i, ft := range f {
		if ft == ">" {
			return i < len(p) // '>' needs at least one token
		}
		if i >= len(p) {
			return false
		}
		switch pt := p[i]; {
		case pt == ">":
			return false // pattern's '>' spans any depth; only '>' covers it
		case ft == "*":
			// covers a literal or '*' token
		case ft != pt:
			return false
		}
	}
	return len(f) == len(p)
}
