package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"time"

	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/wait"
	"github.com/jetbox-dev/jetbox/replication"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
)

// This file is jetbox run --on-lost-slot=repair: the instance that finds
// the slot lost runs jetbox repair's steps (repairer, repair.go) and then
// streams again. One instance at a time repairs (the repair lock); the
// others stand by. Repairs in a row are spaced by a growing back-off.

// Back-off between automatic repairs: a lost slot found again less than
// flapWindow after a repair ended waits repairBackoffMin, doubling up to
// repairBackoffMax, before it is repaired again.
const (
	repairBackoffMin = 30 * time.Second
	repairBackoffMax = 10 * time.Minute
	flapWindow       = 10 * time.Minute
)

// autoRepairable reports whether err, which stopped jetbox run, is one
// --on-lost-slot=repair answers with a repair: a lost slot (missing,
// invalidated) of a table outbox, or an unfinished repair (its marker).
// Everything else stops as with --on-lost-slot=stop: a rewind or a
// branched timeline (jetbox repair replaces such a slot, but only an
// operator may decide that the server is the one to follow), a
// messages-only outbox (nothing to re-read), any other error.
func autoRepairable(err error) bool {
	var he *replication.HistoryError
	if !errors.As(err, &he) || he.NoTable {
		return false
	}
	// A promotion whose timeline left the stream's before its last row:
	// the stream holds rows this server never got (phantoms), and ids the
	// lost transactions used may be handed out again here, which the
	// repair would take for stored. An operator decides (jetbox repair,
	// jetbox audit). With --wait-for-standby-slots naming the promoted
	// standby it does not happen.
	if he.Branched {
		return false
	}
	return he.Case == replication.CaseLostSlot || he.Case == replication.CaseRepair
}

// autoCause is an automatic repair's decision on VerifyHistory's answer,
// read under the repair lock: repair (ok) with the cause; or not, stop
// being the error to stop on (nil: the history is whole, another instance
// repaired meanwhile).
func autoCause(err error) (cause string, ok bool, stop error) {
	var he *replication.HistoryError
	switch {
	case err == nil:
		return "", false, nil
	case autoRepairable(err) && errors.As(err, &he) && he.Case == replication.CaseRepair:
		return causeUnfinished, true, nil
	case autoRepairable(err) && errors.As(err, &he):
		return he.LostCause, true, nil
	default:
		return "", false, err
	}
}

// repairCauses are jetbox_repairs_total's causes.
func repairCauses() []string { return append(replication.LostCauses(), causeUnfinished) }

// autoRepairs runs the automatic repairs of one jetbox run.
type autoRepairs struct {
	cfg            Config
	log            zerolog.Logger
	stdout, stderr io.Writer
	// lastEnd is when this process's last repair ended (zero: none yet);
	// wait the back-off the next one waits if it comes within flapWindow.
	lastEnd time.Time
	wait    time.Duration
	now     func() time.Time
}

func newAutoRepairs(cfg Config, log zerolog.Logger, stdout, stderr io.Writer) *autoRepairs {
	return &autoRepairs{cfg: cfg, log: log.With().Str("component", "repair").Logger(), stdout: stdout, stderr: stderr, now: time.Now}
}

// backoff is how long to wait before the next repair, at now, and whether
// the slot was lost again soon after the last repair (flapping).
func (a *autoRepairs) backoff(now time.Time) (wait time.Duration, again bool) {
	if a.lastEnd.IsZero() || now.Sub(a.lastEnd) >= flapWindow {
		a.wait = 0
		return 0, false
	}
	a.wait = min(max(2*a.wait, repairBackoffMin), repairBackoffMax)
	return max(0, a.wait-now.Sub(a.lastEnd)), true
}

// handle answers the error that stopped a run (cause): when it is one to
// repair, it waits out the back-off and repairs, or stands by while
// another instance repairs. retry says the run should start over; else
// err is what to stop on (cause, or what stopped the repair).
func (a *autoRepairs) handle(ctx context.Context, cause error) (retry bool, err error) {
	if !a.cfg.LostSlot.Repair || !autoRepairable(cause) {
		return false, cause
	}
	var he *replication.HistoryError
	errors.As(cause, &he)
	log := a.log.With().Str("case", he.Case).Str("lost_cause", he.LostCause).Str("after_commit_time", he.Tip.CommitTime).Str("after_lsn", he.Tip.CommitLSN.String()).Logger()
	if he.Tip.RepairSince != "" && !he.Tip.Stored.IsZero() && a.now().Sub(he.Tip.Stored) < flapWindow && he.Case == replication.CaseLostSlot {
		// Any instance's repair: the stream's last message is a repair's.
		log.Error().Stringer("since_repair", a.now().Sub(he.Tip.Stored).Round(time.Second)).
			Msg("the slot is lost again right after a repair (the stream's last message is a repair's): a flapping primary? repairing after a back-off")
		if a.lastEnd.IsZero() {
			a.lastEnd = he.Tip.Stored
		}
	}
	if wait, again := a.backoff(a.now()); again {
		log.Error().Stringer("since_last_repair", a.now().Sub(a.lastEnd).Round(time.Second)).Stringer("backoff", wait).
			Msg("the slot is lost again soon after this instance's last repair (a flapping primary?): waiting before repairing again")
		if !sleep(ctx, wait) {
			return false, nil
		}
	}
	a.cfg.Metrics.SetState(replication.StateRepairing)
	log.Warn().Err(cause).Msg("--on-lost-slot=repair: repairing the stream from the table (jetbox repair's steps), then streaming")
	r := &repairer{cfg: a.cfg, log: a.log, stdout: a.stdout, stderr: a.stderr, margin: a.cfg.LostSlot.Margin,
		progress: 5 * time.Second, createdAt: a.cfg.Replication.CreatedAtColumn, auto: true,
		started: func(cause string) {
			a.cfg.Metrics.Repairs.WithLabelValues(cause).Inc()
			a.log.Info().Str("cause", cause).Msg("repair: started (this instance holds the repair lock; other instances stand by)")
		}}
	res, code, rerr := r.run(ctx)
	if ctx.Err() != nil {
		return false, nil
	}
	switch {
	case errors.Is(rerr, replication.ErrRepairBusy):
		a.cfg.Metrics.SetState(replication.StateStandby)
		retry := a.cfg.Replication.StandbyRetry/2 + time.Duration(rand.Int64N(int64(a.cfg.Replication.StandbyRetry)+1))
		log.Info().Err(rerr).Stringer("retry", retry).Msg("another instance repairs the slot: standing by")
		return sleep(ctx, retry), nil
	case rerr == nil && !res.Repaired:
		log.Info().Msg("repair: nothing to repair any more (another instance repaired the slot): streaming")
		return sleep(ctx, a.cfg.Replication.StandbyRetry/2), nil // never a busy loop
	case rerr == nil:
		a.lastEnd = a.now()
		log.Info().Str("cause", res.Cause).Int64("republished", res.Published).Int64("already_in_stream", res.Skipped).Stringer("elapsed", res.Elapsed.Round(time.Millisecond)).
			Msg("repair: done, streaming from the new slot")
		return true, nil
	}
	var ie *decoder.InvalidEventError
	if (code == exitConfig && !natsGone(rerr)) || errors.As(rerr, &ie) {
		// Refused, or a row it cannot publish: what jetbox repair stops
		// on stops jetbox run too, with jetbox repair's way out.
		return false, fmt.Errorf("--on-lost-slot=repair: the repair stopped: %w", r.stopError(rerr))
	}
	// A server that went away (a promotion in progress): again after a
	// back-off, resuming what this attempt stored.
	a.lastEnd = a.now()
	wait, _ := a.backoff(a.now())
	wait = max(wait, repairBackoffMin)
	log.Error().Err(rerr).Stringer("backoff", wait).Msg("repair: failed; trying again (a re-run resumes it: Jetbox-Repair-Since)")
	return sleep(ctx, wait), nil
}

// natsGone reports whether err, which stopped a repair before it changed
// anything, says NATS could not be reached or did not answer (a restart, a
// network cut; natsUnreachable in check.go): jetbox repair exits 2 on it,
// an automatic repair tries again after a back-off, as jetbox run outlives
// such an outage while it streams.
func natsGone(err error) bool {
	return natsUnreachable(err) || errors.Is(err, nats.ErrNoResponders) || errors.Is(err, nats.ErrConnectionClosed) ||
		errors.Is(err, nats.ErrDisconnected) || errors.Is(err, jetstream.ErrJetStreamNotEnabled) || errors.Is(err, context.DeadlineExceeded)
}

// sleep waits d, or until ctx ends (false).
func sleep(ctx context.Context, d time.Duration) bool { return wait.Sleep(ctx, d) == nil }
