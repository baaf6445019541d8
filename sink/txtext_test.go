package sink

import (
	"fmt"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jetbox-dev/jetbox/decoder"
)

// A repair's rows share one commit LSN, each with its own commit time (its
// order key): the cached transaction text must not carry the first's.
func TestCommitTimePerEvent(t *testing.T) {
	p := &Publisher{}
	var tx txText
	t0 := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	for i, at := range []time.Time{t0, t0, t0.Add(time.Second)} {
		h := p.header(&decoder.Event{ID: fmt.Sprint(i), CommitLSN: 0x100, CommitTime: at, TxIndex: i}, &tx, 0)
		if got, want := h.Get(format.HeaderCommitTime), at.Format(format.CommitTimeLayout); got != want {
			t.Fatalf("event %d: Jetbox-Commit-Time %s, want %s", i, got, want)
		}
	}
}
