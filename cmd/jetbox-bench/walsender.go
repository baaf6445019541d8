package main

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// unsentSampler follows how far a slot's walsender lags behind the WAL it
// could send (pg_current_wal_lsn() - sent_lsn). A lag there means the delay
// is upstream of the forwarder: the walsender decoding, or a socket the
// forwarder does not drain.
type unsentSampler struct {
	cancel context.CancelFunc
	done   chan struct{}
	max    atomic.Int64 // bytes; -1 until a sample was read
}

// sampleUnsent samples slot's walsender every 100 ms until finish.
func (b *bench) sampleUnsent(ctx context.Context, slot string) *unsentSampler {
	ctx, cancel := context.WithCancel(ctx)
	s := &unsentSampler{cancel: cancel, done: make(chan struct{})}
	s.max.Store(-1)
	go func() {
		defer close(s.done)
		conn, err := pgx.Connect(ctx, b.srv.dsn("postgres"))
		if err != nil {
			return
		}
		defer conn.Close(context.Background())
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			var unsent int64
			err := conn.QueryRow(ctx, `SELECT coalesce(pg_current_wal_lsn() - r.sent_lsn, 0)::bigint FROM pg_stat_replication r
				JOIN pg_replication_slots s ON s.active_pid = r.pid WHERE s.slot_name = $1`, slot).Scan(&unsent)
			if err == nil && unsent > s.max.Load() {
				s.max.Store(unsent)
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	return s
}

// finish stops sampling and returns the largest lag seen, in bytes (-1: none read).
func (s *unsentSampler) finish() int64 {
	s.cancel()
	<-s.done
	return s.max.Load()
}
