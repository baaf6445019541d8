package main

import (
	"context"
	"fmt"
	"math/rand"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// load writes outbox transactions from several connections until stopped.
// Writers survive Postgres restarts by reconnecting; whatever committed is
// read back from the oracle slot, so a COMMIT whose reply was lost is fine.
type load struct {
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	txns    atomic.Int64
	rows    atomic.Int64
	errs    atomic.Int64
	lastErr atomic.Value
}

// startLoad runs writers, each committing a transaction of 1-5 rows about
// every pace, until stop is called or maxTxns transactions were written.
func (f *fixture) startLoad(writers int, pace time.Duration, maxTxns int) *load {
	ctx, cancel := context.WithCancel(context.Background())
	l := &load{cancel: cancel}
	for w := 0; w < writers; w++ {
		l.wg.Add(1)
		go func(w int) {
			defer l.wg.Done()
			rng := rand.New(rand.NewSource(int64(w) + time.Now().UnixNano()))
			var conn *pgx.Conn
			defer func() {
				if conn != nil {
					conn.Close(context.Background())
				}
			}()
			tick := time.NewTicker(pace)
			defer tick.Stop()
			for ctx.Err() == nil && l.txns.Load() < int64(maxTxns) {
				if conn == nil {
					c, err := pgx.Connect(ctx, f.pg.DSN)
					if err != nil {
						l.fail(err)
						select {
						case <-ctx.Done():
						case <-tick.C:
						}
						continue
					}
					conn = c
				}
				n := 1 + rng.Intn(5)
				// Not ctx: a cancelled statement may still commit on the
				// server after the client gave up, after the oracle was read.
				sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				insert := `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
					SELECT 'order', $1, 'OrderCreated', jsonb_build_object('writer', $2::int, 'n', g) FROM generate_series(1, $3) g`
				if testMixedSource() { // the rows, then a message, in one transaction
					insert = `WITH r AS (` + insert + ` RETURNING 1)
					SELECT jetbox_emit('order', $1, 'OrderCreated', jsonb_build_object('writer', $2::int, 'message', true)) FROM (SELECT count(*) FROM r) c`
				}
				_, err := conn.Exec(sctx, insert, fmt.Sprintf("w%d", w), w, n)
				cancel()
				if err != nil {
					l.fail(err)
					conn.Close(context.Background())
					conn = nil
				} else {
					l.txns.Add(1)
					l.rows.Add(int64(n))
				}
				select {
				case <-ctx.Done():
				case <-tick.C:
				}
			}
		}(w)
	}
	return l
}

func (l *load) fail(err error) {
	l.errs.Add(1)
	l.lastErr.Store(err.Error())
}

// stop ends the writers and waits for them.
func (l *load) stop() {
	l.cancel()
	l.wg.Wait()
}
