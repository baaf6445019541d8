package sink

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jetbox-dev/jetbox/internal/check"
	"github.com/nats-io/nats.go/jetstream"
)

// Check inspects the NATS side without changing anything: JetStream enabled,
// the stream (or that it can be created), its subjects, duplicate window
// (warned when shorter than maxOutage), message size limits, storage and
// replicas, in exactly-once mode whether the stream supports it (see
// checkExactlyOnce), and with ExactlyOnceAtomic whether the server and the
// stream take atomic batches, and how large.
func (p *Publisher) Check(ctx context.Context, maxOutage time.Duration) []check.Finding {
	var l check.List
	l.Add(check.Info, "nats.server", fmt.Sprintf("connected to %s (server %s), max_payload %d bytes",
		p.nc.ConnectedUrlRedacted(), p.nc.ConnectedServerVersion(), p.nc.MaxPayload()), "")
	if _, err := p.js.AccountInfo(ctx); err != nil {
		fix := "enable JetStream on the server (nats-server -js, or jetstream {} in its config) and for this account"
		if errors.Is(err, context.DeadlineExceeded) {
			fix = "check the server answers JetStream API requests; " + fix
		}
		l.Add(check.Error, "nats.jetstream", "JetStream is not available: "+err.Error(), fix)
		return l
	}
	want := p.cfg.SubjectPrefix + ".>"
	s, err := p.js.Stream(ctx, p.cfg.Stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		subjects := []string{want}
		if dl := p.cfg.DeadLetterSubject + ".>"; p.cfg.DeadLetterSubject != "" {
			subjects = append(subjects, dl)
		}
		sc, why := p.streamConfig(subjects)
		l.Add(check.Create, "nats.stream", fmt.Sprintf("stream %q is missing: jetbox run creates it with %s (replicas from %s)",
			p.cfg.Stream, DescribeStream(sc), why), "")
		if sc.Replicas < 3 {
			l.Add(check.Warning, "nats.replicas", fmt.Sprintf("the stream would have %d replica(s) (%s): a PubAck is not an fsync, so a power loss of the server can lose acked messages", sc.Replicas, why),
				"use a JetStream cluster of 3 servers in production (or sync_interval: always on the server)")
		}
		if maxOutage > p.cfg.DuplicateWindow && !p.cfg.Delivery.ExactlyOnce() {
			l.Add(check.Warning, "nats.duplicate_window", fmt.Sprintf("--duplicate-window %s is shorter than --max-outage %s: a replay after a longer outage stores copies", p.cfg.DuplicateWindow, maxOutage),
				"raise --duplicate-window before the stream is created")
		}
		if p.cfg.Delivery.Atomic() {
			p.checkAtomic(ctx, &l, false, false)
		}
		return l
	}
	if err != nil {
		l.Add(check.Error, "nats.stream", fmt.Sprintf("look up stream %q: %v", p.cfg.Stream, err), "check the account may use the JetStream API ($JS.API.>)")
		return l
	}
	cfg := s.CachedInfo().Config
	l.Add(check.Info, "nats.stream_config", fmt.Sprintf("stream %q has %s", p.cfg.Stream, DescribeStream(cfg)), "")
	if d := p.Drift(cfg); len(d) > 0 {
		l.Add(check.Warning, "nats.stream_config", DriftText(p.cfg.Stream, d), p.DriftFix(d))
	}
	if !Captures(cfg.Subjects, want) {
		l.Add(check.Error, "nats.stream", fmt.Sprintf("stream %q has subjects %q, which do not capture %q", p.cfg.Stream, cfg.Subjects, want),
			fmt.Sprintf("add %q to the stream's subjects, or set --subject-prefix / --stream to match", want))
	} else {
		l.Add(check.Info, "nats.stream", fmt.Sprintf("stream %q captures %q (%d messages)", p.cfg.Stream, want, s.CachedInfo().State.Msgs), "")
	}
	// Every template subject is under <prefix>.> (the template starts with
	// {prefix}), so the check above covers them; say so when it passed.
	if f := p.cfg.SubjectFilter; f != "" && Captures(cfg.Subjects, want) && Captures(cfg.Subjects, f) {
		l.Add(check.Info, "nats.subjects", fmt.Sprintf("stream %q captures every subject the subject template produces (%s)", p.cfg.Stream, f), "")
	}
	if dl := p.cfg.DeadLetterSubject + ".>"; p.cfg.DeadLetterSubject != "" {
		if Captures(cfg.Subjects, dl) {
			l.Add(check.Info, "nats.dead_letter", fmt.Sprintf("dead letters go to %s, in stream %q", dl, p.cfg.Stream), "")
		} else {
			l.Add(check.Error, "nats.dead_letter", fmt.Sprintf("stream %q has subjects %q, which do not capture the dead letters %q", p.cfg.Stream, cfg.Subjects, dl),
				fmt.Sprintf("add %q to the stream's subjects, or change --dead-letter-subject", dl))
		}
	}
	if p.cfg.Delivery.ExactlyOnce() {
		l.Add(check.Info, "nats.duplicate_window", fmt.Sprintf("duplicate window %s (exactly-once skips replays by position, whatever the window)", cfg.Duplicates), "")
	} else if cfg.Duplicates < maxOutage {
		l.Add(check.Warning, "nats.duplicate_window", fmt.Sprintf("stream duplicate window %s is shorter than --max-outage %s: a replay after a longer outage (or a Postgres crash) stores copies", cfg.Duplicates, maxOutage),
			fmt.Sprintf("nats stream edit %s --dupe-window %s", p.cfg.Stream, maxOutage))
	} else {
		l.Add(check.Info, "nats.duplicate_window", fmt.Sprintf("duplicate window %s", cfg.Duplicates), "")
	}
	if cfg.MaxMsgSize > 0 {
		l.Add(check.Info, "nats.max_msg_size", fmt.Sprintf("stream max_msg_size %d bytes: larger outbox rows stop jetbox", cfg.MaxMsgSize), "")
	}
	if cfg.Storage == jetstream.MemoryStorage {
		l.Add(check.Warning, "nats.storage", "memory storage: a server restart loses the stream's messages (and their dedup ids)", "use file storage")
	}
	if cfg.Replicas < 3 {
		fix := "use an R3 stream on a JetStream cluster in production (or sync_interval: always on the server)"
		if n, _ := p.AutoReplicas(); n > max(cfg.Replicas, 1) {
			fix = fmt.Sprintf("nats stream edit %s --replicas %d", p.cfg.Stream, n)
		}
		l.Add(check.Warning, "nats.replicas", fmt.Sprintf("%d replica(s): a PubAck is not an fsync, so a power loss of the server can lose acked messages", max(cfg.Replicas, 1)), fix)
	}
	if p.cfg.Delivery.ExactlyOnce() {
		p.checkExactlyOnce(ctx, &l, s, maxOutage)
	}
	if p.cfg.Delivery.Atomic() {
		p.checkAtomic(ctx, &l, true, cfg.AllowAtomicPublish)
	}
	if cfg.Retention != jetstream.LimitsPolicy && !p.cfg.Delivery.ExactlyOnce() {
		l.Add(check.Warning, "nats.retention", "retention is not limits: removed messages take their dedup ids with them", "prefer limits retention for the outbox stream")
	}
	return l
}

// checkAtomic reports whether the server (and the stream, if it exists)
// take atomic batches, and the batch limit jetbox will use.
func (p *Publisher) checkAtomic(ctx context.Context, l *check.List, exists, streamAllows bool) {
	problem := func(err error) {
		var pe *PermanentError
		if errors.As(err, &pe) {
			l.Add(check.Error, "nats.atomic", pe.Err.Error(), pe.Hint)
		} else {
			l.Add(check.Error, "nats.atomic", err.Error(), "check the NATS server answers (nats-server 2.12 or later) and retry")
		}
	}
	if err := p.atomicSupport(true); err != nil {
		problem(err)
		return
	}
	if !exists {
		l.Add(check.Info, "nats.atomic", fmt.Sprintf("server %s takes atomic batches: jetbox run creates stream %q with atomic publish allowed", p.nc.ConnectedServerVersion(), p.cfg.Stream), "")
		return
	}
	if err := p.atomicSupport(streamAllows); err != nil {
		problem(err)
		return
	}
	n, err := p.AtomicBatchLimit(ctx)
	if err != nil {
		problem(err)
		return
	}
	l.Add(check.Info, "nats.atomic", fmt.Sprintf("atomic batches of up to %d messages: a transaction of up to %d rows is stored whole or not at all; larger ones in atomic chunks, the last message marked %s: true", n, n, format.HeaderTxLast), "")
}

// SharedStreamFix is the fix for a stream that cannot support exactly-once
// delivery: a stream of jetbox's own, or dedup mode for a shared one.
const SharedStreamFix = "give jetbox a stream of its own (limits retention, no max age, only jetbox's subjects; jetbox creates one if --stream names a missing stream), " +
	"or run with --delivery=dedup, the mode for a stream shared with other publishers or consumed as a work queue"

// checkExactlyOnce reports what keeps the stream from supporting
// exactly-once delivery, which resumes from the stream's last message and
// needs jetbox to be the stream's only writer. Errors: retention that lets
// consumers remove messages (work queue, interest), sources (other
// writers), a last message jetbox did not write or cannot read, a max age
// below maxOutage. Warnings: a longer max age (a quiet spell longer than it
// expires the last message), subjects beyond jetbox's. Message and byte
// limits with discard old never remove the newest message, so they are fine.
func (p *Publisher) checkExactlyOnce(ctx context.Context, l *check.List, s jetstream.Stream, maxOutage time.Duration) {
	const name = "nats.exactly_once"
	info := s.CachedInfo()
	cfg, st := info.Config, info.State
	problems := 0
	refuse := func(what string) {
		problems++
		l.Add(check.Error, name, fmt.Sprintf("stream %q cannot support exactly-once delivery (the default): %s", p.cfg.Stream, what), SharedStreamFix)
	}
	if cfg.Retention == jetstream.WorkQueuePolicy || cfg.Retention == jetstream.InterestPolicy {
		refuse(fmt.Sprintf("%s retention removes consumed messages, and with them the stream's last message, where exactly-once resumes", cfg.Retention))
	}
	if len(cfg.Sources) > 0 {
		var from []string
		for _, src := range cfg.Sources {
			from = append(from, src.Name)
		}
		refuse(fmt.Sprintf("it sources messages from %q: jetbox would not be its only writer", from))
	}
	if cfg.MaxAge > 0 {
		what := fmt.Sprintf("max age %s: when no outbox row commits for longer, the stream's last message, where exactly-once resumes, expires and jetbox's next start or reconnect stops (exit 1)", cfg.MaxAge)
		if cfg.MaxAge < maxOutage {
			refuse(what + fmt.Sprintf(", and --max-outage %s is longer", maxOutage))
		} else {
			l.Add(check.Warning, name, fmt.Sprintf("stream %q has %s", p.cfg.Stream, what),
				fmt.Sprintf("nats stream edit %s --max-age 0 (or keep it far above the longest quiet spell plus outage), or use --delivery=dedup", p.cfg.Stream))
		}
	}
	ours := []string{p.cfg.SubjectPrefix + ".>"}
	if p.cfg.DeadLetterSubject != "" {
		ours = append(ours, p.cfg.DeadLetterSubject+".>")
	}
	var extra []string
	for _, subj := range cfg.Subjects {
		if !Captures(ours, subj) {
			extra = append(extra, subj)
		}
	}
	if len(extra) > 0 {
		l.Add(check.Warning, name, fmt.Sprintf("stream %q also captures %q: a message another publisher stores there stops exactly-once delivery (exit 1)", p.cfg.Stream, extra), SharedStreamFix)
	}
	if st.LastSeq > 0 {
		if m, err := s.GetMsg(ctx, st.LastSeq); err != nil {
			refuse(fmt.Sprintf("cannot read the stream's last message (seq %d), where exactly-once resumes: %v", st.LastSeq, err))
		} else if _, ok := format.ParsePosition(m.Header); !ok {
			refuse(fmt.Sprintf("the stream's last message (seq %d, subject %s) was not written by jetbox: another publisher writes the stream", st.LastSeq, m.Subject))
		} else if problems == 0 {
			l.Add(check.Info, name, fmt.Sprintf("exactly-once: resumes after seq %d", st.LastSeq), "")
		}
	} else if problems == 0 {
		l.Add(check.Info, name, "exactly-once: the stream is empty, jetbox starts it", "")
	}
}
