package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/jetbox-dev/jetbox/replication"
	"github.com/rs/zerolog"
)

// TestAutoRepairDecision: which errors that stop jetbox run
// --on-lost-slot=repair repairs (a lost slot of a table outbox, whatever
// its cause, and an unfinished repair), and which still stop it (what
// jetbox repair refuses, needs a flag for, or only an operator may decide).
func TestAutoRepairDecision(t *testing.T) {
	lost := func(cause string) error {
		return fmt.Errorf("session: %w", &replication.HistoryError{Case: replication.CaseLostSlot, LostCause: cause})
	}
	for _, c := range []struct {
		name   string
		err    error
		repair bool
		cause  string
	}{
		{"promotion without the slot", lost(replication.LostPromotion), true, "promotion"},
		{"promotion on a timeline that branched before the stream's tip (phantoms)", &replication.HistoryError{Case: replication.CaseLostSlot, LostCause: replication.LostPromotion, Branched: true}, false, ""},
		{"invalidated slot", lost(replication.LostInvalidated), true, "invalidated"},
		{"dropped slot", lost(replication.LostDropped), true, "dropped"},
		{"unfinished repair (its marker)", &replication.HistoryError{Case: replication.CaseRepair}, true, "unfinished-repair"},
		{"messages-only outbox: nothing to re-read", &replication.HistoryError{Case: replication.CaseLostSlot, LostCause: replication.LostPromotion, NoTable: true}, false, ""},
		{"rewind (a restore written past the tip)", &replication.HistoryError{Case: replication.CaseRewind}, false, ""},
		{"timeline branched before the tip, slot present", &replication.HistoryError{Case: replication.CaseTimeline}, false, ""},
		{"settings changed", &replication.SettingsError{Setting: "routing"}, false, ""},
		{"any other error", errors.New("boom"), false, ""},
		{"a clean stop", nil, false, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := autoRepairable(c.err); got != c.repair {
				t.Fatalf("autoRepairable = %v, want %v", got, c.repair)
			}
			cause, ok, stop := autoCause(c.err)
			if ok != c.repair || cause != c.cause {
				t.Fatalf("autoCause = %q, %v, want %q, %v", cause, ok, c.cause, c.repair)
			}
			if !ok && c.err != nil && stop != c.err {
				t.Fatalf("autoCause stops on %v, want the error itself", stop)
			}
		})
	}
	// Under the lock, a whole history means another instance repaired.
	if _, ok, stop := autoCause(nil); ok || stop != nil {
		t.Fatal("a whole history is repaired, or stopped on")
	}
	for _, c := range repairCauses() {
		if c == "" || strings.Contains(c, " ") {
			t.Fatalf("cause %q", c)
		}
	}
}

// TestAutoRepairBackoff: the first repair runs at once; a lost slot found
// again within flapWindow of a repair's end waits a back-off that doubles
// up to repairBackoffMax; a quiet flapWindow resets it.
func TestAutoRepairBackoff(t *testing.T) {
	a := &autoRepairs{}
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	if w, again := a.backoff(t0); w != 0 || again {
		t.Fatalf("first repair waits %s (again %v)", w, again)
	}
	a.lastEnd = t0
	var waits []time.Duration
	now := t0
	for range 7 {
		now = now.Add(time.Second)
		w, again := a.backoff(now)
		if !again {
			t.Fatal("a loss 1 s after a repair is not reported as again")
		}
		waits = append(waits, w+time.Second) // from the last repair's end
		a.lastEnd = now
	}
	want := []time.Duration{30 * time.Second, time.Minute, 2 * time.Minute, 4 * time.Minute, 8 * time.Minute, 10 * time.Minute, 10 * time.Minute}
	for i := range want {
		if waits[i] != want[i] {
			t.Fatalf("back-offs %v, want %v", waits, want)
		}
	}
	if w, again := a.backoff(now.Add(flapWindow)); w != 0 || again {
		t.Fatalf("after a quiet %s: wait %s, again %v", flapWindow, w, again)
	}
}

// TestOnLostSlotConfig: the flag's values and what it excludes.
func TestOnLostSlotConfig(t *testing.T) {
	for _, c := range []struct {
		mode, accept, source, margin string
		want                         string // "": valid
	}{
		{"repair", "false", "table", "10m", ""},
		{"stop", "false", "table", "10m", ""},
		{"stop", "true", "messages", "10m", ""},
		{"maybe", "false", "table", "10m", "unknown value"},
		{"repair", "true", "table", "10m", "exclude each other"},
		{"repair", "false", "messages", "10m", "exist only in the WAL"},
		{"repair", "false", "table,messages", "10m", "exist only in the WAL"},
		{"repair", "false", "table", "soon", "not a duration"},
	} {
		var f RunFlags
		parseDefaults(t, &f)
		f.PostgresURL = "postgres://u@127.0.0.1/db"
		f.OnLostSlot, f.Source = c.mode, c.source
		f.AcceptLostRows.set(c.accept)
		f.LostSlotMargin.set(c.margin)
		cfg, err := f.Config()
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%+v: %v", c, err)
		case c.want == "" && (cfg.LostSlot.Repair != (c.mode == "repair") || cfg.Replication.AutoRepair != cfg.LostSlot.Repair || cfg.LostSlot.Margin != 10*time.Minute):
			t.Errorf("%+v: %+v", c, cfg.LostSlot)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "--on-lost-slot")):
			t.Errorf("%+v: error %v, want %q", c, err, c.want)
		}
	}
}

// TestAutoRepairRetriesUnreachableNATS: a lost slot found while NATS is
// down (restarting) is repaired once it is back: the repair's failure to
// reach it is retried after a back-off, as a Postgres it cannot reach is,
// not a reason to stop jetbox run.
func TestAutoRepairRetriesUnreachableNATS(t *testing.T) {
	var f RunFlags
	parseDefaults(t, &f)
	f.PostgresURL = "postgres://u@127.0.0.1:1/db"
	f.NatsURL = "nats://127.0.0.1:1" // nothing listens
	f.OnLostSlot = "repair"
	cfg, err := f.Config()
	if err != nil {
		t.Fatal(err)
	}
	cfg.Metrics = metrics.New()
	a := newAutoRepairs(cfg, zerolog.Nop(), io.Discard, io.Discard)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	cause := &replication.HistoryError{Case: replication.CaseLostSlot, LostCause: replication.LostDropped}
	retry, err := a.handle(ctx, cause)
	if err != nil {
		t.Fatalf("handle stopped jetbox run on an unreachable NATS: %v", err)
	}
	if retry || ctx.Err() == nil {
		t.Fatalf("handle returned retry=%v before its back-off ended (ctx %v)", retry, ctx.Err())
	}
}
