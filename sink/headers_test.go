package sink_test

import (
	"testing"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/nats-io/nats.go"
)

func TestParsePosition(t *testing.T) {
	hdr := func(lsn, idx string) nats.Header {
		h := nats.Header{}
		if lsn != "" {
			h.Set(format.HeaderCommitLSN, lsn)
		}
		if idx != "" {
			h.Set(format.HeaderTxIndex, idx)
		}
		return h
	}
	for _, c := range []struct {
		h    nats.Header
		want format.Position
		ok   bool
	}{
		{hdr("0/16B3748", "0"), format.Position{CommitLSN: 0x16B3748}, true},
		{hdr("1A/FF000010", "12"), format.Position{CommitLSN: 0x1AFF000010, TxIndex: 12}, true},
		{hdr("", "0"), format.Position{}, false},          // not jetbox's
		{hdr("0/16B3748", ""), format.Position{}, false},  // no index
		{hdr("16B3748", "0"), format.Position{}, false},   // not X/X
		{hdr("0/16B3748", "x"), format.Position{}, false}, // not a number
		{nats.Header{}, format.Position{}, false},
	} {
		got, ok := format.ParsePosition(c.h)
		if got != c.want || ok != c.ok {
			t.Errorf("ParsePosition(%v) = %v, %v; want %v, %v", c.h, got, ok, c.want, c.ok)
		}
	}
	// The headers jetbox writes read back as the position they came from.
	want := format.Position{CommitLSN: 0x16B3748, TxIndex: 3}
	if got, ok := format.ParsePosition(hdr("0/16B3748", "3")); !ok || got != want || got.String() != "0/16B3748#3" {
		t.Errorf("got %v (%v), want %v", got, ok, want)
	}
}

func TestPositionCompare(t *testing.T) {
	// In stream order: commit LSN first, then the index in the transaction.
	order := []format.Position{
		{CommitLSN: 0x100, TxIndex: 0},
		{CommitLSN: 0x100, TxIndex: 1},
		{CommitLSN: 0x100, TxIndex: 10},
		{CommitLSN: 0x101, TxIndex: 0},
		{CommitLSN: 0x1_0000_0000, TxIndex: 0},
	}
	for i, p := range order {
		for j, q := range order {
			want := 0
			switch {
			case i < j:
				want = -1
			case i > j:
				want = 1
			}
			if got := p.Compare(q); got != want {
				t.Errorf("%v.Compare(%v) = %d, want %d", p, q, got, want)
			}
			if got := p.Less(q); got != (i < j) {
				t.Errorf("%v.Less(%v) = %v, want %v", p, q, got, i < j)
			}
		}
	}
}
