package main

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// waitCounts counts, per walsender ("jetbox" or "floor") and wait event
// ("type:event", or "running" for none), how often a sample found it so.
type waitCounts map[string]int

// String lists the counts, most frequent first, as who/event=n.
func (w waitCounts) String() string {
	keys := slices.Collect(maps.Keys(w))
	slices.SortFunc(keys, func(a, b string) int { return w[b] - w[a] })
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s=%d", k, w[k])
	}
	return strings.Join(parts, " ")
}

// waitSampler samples the wait events of two slots' walsenders.
type waitSampler struct {
	cancel context.CancelFunc
	done   chan struct{}
	counts waitCounts
}

// waitSampleEvery is the wait sampler's period.
const waitSampleEvery = 20 * time.Millisecond

// sampleWaits samples the walsenders of slot (jetbox's) and floorSlot
// every waitSampleEvery until finish.
func (b *bench) sampleWaits(ctx context.Context, slot, floorSlot string) *waitSampler {
	ctx, cancel := context.WithCancel(ctx)
	s := &waitSampler{cancel: cancel, done: make(chan struct{}), counts: waitCounts{}}
	go func() {
		defer close(s.done)
		conn, err := pgx.Connect(ctx, b.srv.dsn("postgres"))
		if err != nil {
			return
		}
		defer conn.Close(context.Background())
		tick := time.NewTicker(waitSampleEvery)
		defer tick.Stop()
		for {
			rows, err := conn.Query(ctx, `SELECT CASE WHEN s.slot_name = $1 THEN 'jetbox' ELSE 'floor' END,
				coalesce(a.wait_event_type || ':' || a.wait_event, 'running')
				FROM pg_replication_slots s JOIN pg_stat_activity a ON a.pid = s.active_pid
				WHERE s.slot_name IN ($1, $2)`, slot, floorSlot)
			if err == nil {
				for rows.Next() {
					var who, ev string
					if rows.Scan(&who, &ev) == nil {
						s.counts[who+"/"+ev]++
					}
				}
				rows.Close()
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

// finish stops sampling and returns the counts.
func (s *waitSampler) finish() waitCounts {
	s.cancel()
	<-s.done
	return s.counts
}
