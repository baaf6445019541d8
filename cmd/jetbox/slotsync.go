package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jetbox-dev/jetbox/internal/check"
	"github.com/jetbox-dev/jetbox/replication"
	"github.com/rs/zerolog"
)

// standbyTimeout bounds one standby's connection and queries: an
// unreachable standby delays only the next look at the standbys.
const standbyTimeout = 5 * time.Second

// standbyURLs parses --standby-urls: comma-separated libpq URLs or DSNs,
// one host each.
func standbyURLs(v string, bad func(flag, value, problem, fix string)) []string {
	var urls []string
	for _, u := range strings.Split(v, ",") {
		u = strings.TrimSpace(u)
		if u == "" {
			continue
		}
		if _, err := pgconn.ParseConfig(u); err != nil {
			bad("standby-urls", redact(u), "cannot be parsed: "+redact(err.Error()), "give libpq URLs (postgres://user:pass@standby:5432/db), one host each, separated by commas")
			continue
		}
		urls = append(urls, u)
	}
	return urls
}

// standbyName is a standby's label in metrics, logs and /readyz: host:port.
func standbyName(u string) string {
	c, err := pgconn.ParseConfig(u)
	if err != nil {
		return redact(u)
	}
	return net.JoinHostPort(c.Host, strconv.Itoa(int(c.Port)))
}

// slotWatch watches, while this instance streams, each standby of
// --standby-urls for its copy of the failover slot: every --monitor-interval
// it reads whether the copy is synchronised and persisted (PostgreSQL drops
// a temporary copy at promotion) into jetbox_failover_slot_ready and the
// /readyz warnings, and asks the standby to synchronise now
// (pg_sync_replication_slots(), which a standby whose slotsync worker runs
// refuses: then the worker does it, on its own schedule). It runs in its own goroutine, on a
// connection per standby: the stream never waits for it.
type slotWatch struct {
	cfg       Config
	streaming func() bool
	idle      func() bool // another instance holds the slot, or jetbox stopped
	log       zerolog.Logger
	standbys  []*watchedStandby
	warnings  atomic.Pointer[[]string]
}

// watchedStandby is one standby of a slotWatch.
type watchedStandby struct {
	url, name  string
	conn       *pgx.Conn
	worker     bool      // the slotsync worker runs: pg_sync_replication_slots() is refused
	syncFailed bool      // the last pg_sync_replication_slots() failed (logged once)
	ready      bool      // the copy was persisted at the last look
	since      time.Time // the start of the watch while not ready
	last       string    // the state last logged
}

func newSlotWatch(cfg Config, streaming, idle func() bool, log zerolog.Logger) *slotWatch {
	w := &slotWatch{cfg: cfg, streaming: streaming, idle: idle, log: log.With().Str("component", "standby-slots").Logger()}
	for _, u := range cfg.StandbyURLs {
		w.standbys = append(w.standbys, &watchedStandby{url: u, name: standbyName(u)})
	}
	return w
}

// run looks at the standbys every --monitor-interval while this instance
// streams (the first look as soon as it streams: right after it created the
// slot), until ctx ends.
func (w *slotWatch) run(ctx context.Context) {
	defer w.close()
	active := false
	for {
		wait := w.cfg.Replication.MonitorInterval
		if !active {
			wait = min(wait, 100*time.Millisecond)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		switch {
		case w.streaming():
			active = true
			w.poll(ctx)
		case active && w.idle():
			active = false // another instance streams: it watches
			w.reset()
		}
	}
}

// Warnings are /readyz's warnings about the standbys; none when all hold a
// persisted copy.
func (w *slotWatch) Warnings() []string {
	if w == nil {
		return nil
	}
	if p := w.warnings.Load(); p != nil {
		return *p
	}
	return nil
}

// poll looks at every standby once, concurrently.
func (w *slotWatch) poll(ctx context.Context) {
	warnings := make([]string, len(w.standbys))
	var wg sync.WaitGroup
	for i, s := range w.standbys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			warnings[i] = w.look(ctx, s)
		}()
	}
	wg.Wait()
	if ctx.Err() != nil {
		return
	}
	var ws []string
	for _, s := range warnings {
		if s != "" {
			ws = append(ws, s)
		}
	}
	w.warnings.Store(&ws)
}

// look reads one standby's copy, asking it to synchronise first while the
// copy is not persisted; it returns the /readyz warning, "" when ready.
func (w *slotWatch) look(ctx context.Context, s *watchedStandby) string {
	if s.since.IsZero() {
		s.since = time.Now()
	}
	st, err := w.read(ctx, s, true)
	if ctx.Err() != nil {
		return ""
	}
	gauge := w.cfg.Metrics.FailoverSlotReady.WithLabelValues(s.name)
	if err != nil {
		gauge.Set(0)
		s.ready = false
		w.logState(s, "unreachable", func(e *zerolog.Event) *zerolog.Event { return e.Err(err) })
		return fmt.Sprintf("standby %s: cannot read jetbox's slot there (%s): whether a promotion of it keeps the slot is unknown", s.name, redact(err.Error()))
	}
	if st.Ready() {
		gauge.Set(1)
		if !s.ready {
			w.logState(s, "ready", func(e *zerolog.Event) *zerolog.Event {
				return e.Stringer("waited", time.Since(s.since).Round(time.Millisecond))
			})
		}
		s.ready = true
		return ""
	}
	gauge.Set(0)
	s.ready = false
	w.logState(s, st.State(), func(e *zerolog.Event) *zerolog.Event { return e.Bool("slotsync_worker", st.SyncWorker) })
	return fmt.Sprintf("standby %s: slot %q %s", s.name, w.cfg.Replication.Slot, st.State())
}

// read connects if need be, reads the copy and, with sync, asks a standby
// without a slotsync worker to synchronise the slots now: there jetbox's
// calls are what keeps the copy (and the WAL it holds) moving, so it asks at
// every look, the copy persisted or not.
func (w *slotWatch) read(ctx context.Context, s *watchedStandby, sync bool) (replication.StandbySlot, error) {
	qctx, cancel := context.WithTimeout(ctx, standbyTimeout)
	defer cancel()
	if s.conn == nil || s.conn.IsClosed() {
		conn, err := pgx.Connect(qctx, s.url)
		if err != nil {
			return replication.StandbySlot{}, fmt.Errorf("connect: %w", err)
		}
		s.conn = conn
	}
	st, err := replication.ReadStandbySlot(qctx, s.conn, w.cfg.Replication.Slot)
	if err == nil && sync && st.InRecovery && st.Version >= 170000 && !st.SyncWorker && !s.worker {
		switch err := replication.SyncStandbySlots(qctx, s.conn); {
		case err == replication.ErrSyncWorker:
			s.worker = true
			w.log.Info().Str("standby", s.name).Msg(err.Error())
		case err != nil:
			if !s.syncFailed {
				w.log.Warn().Err(errors.New(redact(err.Error()))).Str("standby", s.name).Msg("could not synchronise the slots on the standby: trying again at every look")
			}
			s.syncFailed = true
		default:
			s.syncFailed = false
			st, err = replication.ReadStandbySlot(qctx, s.conn, w.cfg.Replication.Slot)
		}
	}
	if err != nil {
		s.conn.Close(context.WithoutCancel(ctx))
		s.conn = nil
	}
	return st, err
}

// logState logs a standby's state when it changes.
func (w *slotWatch) logState(s *watchedStandby, state string, add func(*zerolog.Event) *zerolog.Event) {
	if state == s.last {
		return
	}
	s.last = state
	ev := w.log.Warn()
	if state == "ready" {
		ev = w.log.Info()
		state = "the slot's copy is synchronised and persisted: a promotion of this standby keeps the slot"
	}
	add(ev.Str("standby", s.name).Str("slot", w.cfg.Replication.Slot)).Msg(state)
}

// reset forgets the standbys' states while another instance streams (it
// exports them): this instance exports no jetbox_failover_slot_ready.
func (w *slotWatch) reset() {
	w.cfg.Metrics.FailoverSlotReady.Reset()
	w.warnings.Store(nil)
	w.close()
	for _, s := range w.standbys {
		s.ready, s.since, s.last = false, time.Time{}, ""
	}
}

func (w *slotWatch) close() {
	for _, s := range w.standbys {
		if s.conn != nil {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			s.conn.Close(ctx)
			cancel()
			s.conn = nil
		}
	}
}

// standbyFindings are jetbox check's findings about --standby-urls: per
// standby, whether it holds a synchronised, persisted copy of the slot. An
// unreachable standby is a warning: it does not stop jetbox.
func standbyFindings(ctx context.Context, cfg Config) []check.Finding {
	w := newSlotWatch(cfg, nil, nil, zerolog.Nop())
	defer w.close()
	fs := make([]check.Finding, len(w.standbys))
	var wg sync.WaitGroup
	for i, s := range w.standbys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, err := w.read(ctx, s, false) // check changes nothing
			f := check.Finding{Severity: check.Info, Check: "postgres.standby_slot"}
			switch {
			case err != nil:
				f.Severity, f.What = check.Warning, fmt.Sprintf("standby %s: cannot read slot %q there: %s", s.name, cfg.Replication.Slot, redact(err.Error()))
				f.Hint = "check that URL of --standby-urls (host, port, user, password) and that the standby is up"
			case st.Ready():
				f.What = fmt.Sprintf("standby %s: slot %q %s", s.name, cfg.Replication.Slot, st.State())
			default:
				f.Severity, f.What = check.Warning, fmt.Sprintf("standby %s: slot %q %s", s.name, cfg.Replication.Slot, st.State())
				f.Hint = standbyHint(st)
			}
			fs[i] = f
		}()
	}
	wg.Wait()
	return fs
}

// standbyHint says what to do about a standby that would not keep the slot.
func standbyHint(st replication.StandbySlot) string {
	switch {
	case st.Version < 170000 || !st.InRecovery:
		return "remove it from --standby-urls, or give a PostgreSQL 17+ standby of the primary"
	case st.Temporary || !st.Exists:
		if !st.SyncWorker {
			return "on that standby: ALTER SYSTEM SET sync_replication_slots = on; SELECT pg_reload_conf() (or let jetbox run call pg_sync_replication_slots()); the copy is persisted once jetbox streams and the primary's slot moves on: wait, a promotion before then loses the slot"
		}
		return "wait while jetbox streams: the copy is persisted once the primary's slot moves past what the standby holds; a promotion before then loses the slot (see docs/failure-modes.md)"
	}
	return "drop that slot on the standby (SELECT pg_drop_replication_slot(...)): the slotsync worker then synchronises the primary's"
}

// syncStandbys asks each standby of --standby-urls once to synchronise the
// failover slots now (jetbox repair, once its slot became a failover slot)
// and logs what each holds: jetbox run watches on from there.
func syncStandbys(ctx context.Context, cfg Config, log zerolog.Logger) {
	w := newSlotWatch(cfg, nil, nil, log)
	defer w.close()
	for _, s := range w.standbys {
		st, err := w.read(ctx, s, true)
		ev := w.log.Info()
		if err != nil || !st.Ready() {
			ev = w.log.Warn().AnErr("error", err)
		}
		ev.Str("standby", s.name).Str("slot", cfg.Replication.Slot).Str("state", st.State()).Msg("the standby's copy of the slot")
	}
}
