package sink

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// StreamSpec is what jetbox gives a stream it creates, beyond its subjects:
// replicas, limits, storage, discard policy and duplicate window
// (Config.DuplicateWindow). An existing stream is never changed: Drift
// compares it with the settings given explicitly (Given), and EnsureStream
// and Check report each difference with the `nats stream edit` line that
// fixes it.
type StreamSpec struct {
	// Replicas: 0 chooses from what the server tells (AutoReplicas): up to
	// 3 on a cluster, 1 on a single server.
	Replicas int
	MaxAge   time.Duration // 0: no limit
	MaxBytes int64         // -1 (or 0): no limit
	MaxMsgs  int64         // -1 (or 0): no limit
	Storage  jetstream.StorageType
	Discard  jetstream.DiscardPolicy
	// Given holds the flag names (replicas, max-age, max-bytes, max-msgs,
	// storage, discard, duplicate-window) set explicitly: only those are
	// compared with an existing stream, so a stream managed elsewhere with
	// its own limits is not reported for defaults nobody asked for.
	Given map[string]bool
}

// ExactlyOnceDuplicateWindow is the duplicate window of a stream jetbox
// creates for exactly-once delivery when --duplicate-window is not given.
// That mode does not rely on the window: every publish carries
// Nats-Expected-Last-Sequence, so a retry or a replay of a message already
// stored is refused (and the next session resumes after the stream's last
// message) whether the window still holds its id or not. The recovery tests
// run under this window. The server keeps every id of the window in memory
// and its GC scans them: a long window at a high rate costs it CPU on every
// message (10,000,000-row catch-up: 52,567 events/s with 1m, 60,722 with 1s;
// docs/performance.md).
const ExactlyOnceDuplicateWindow = time.Second

// DuplicateWindowFor is the duplicate window of a stream jetbox creates when
// --duplicate-window is not given: ExactlyOnceDuplicateWindow in
// exactly-once mode; dedup mode relies on the window for replays after an
// outage and for its own retries (a publish whose ack is lost is sent again
// once publishTimeout has passed), so there it is the longer of maxOutage
// and twice publishTimeout.
func DuplicateWindowFor(exactlyOnce bool, publishTimeout, maxOutage time.Duration) time.Duration {
	if exactlyOnce {
		return ExactlyOnceDuplicateWindow
	}
	if publishTimeout <= 0 {
		publishTimeout = DefaultPublishTimeout
	}
	return max(2*publishTimeout, maxOutage)
}

// AutoReplicas is the replica count of a stream jetbox creates with
// Replicas 0, from the server's INFO: 1 when the server is not in a
// cluster; otherwise 3, or the number of servers the cluster advertises
// (connect_urls) when that is fewer. A cluster that does not advertise
// (no_advertise) counts as 3; a stream it cannot place fails to create,
// with the fix.
func (p *Publisher) AutoReplicas() (n int, why string) {
	cluster := p.nc.ConnectedClusterName()
	if cluster == "" {
		return 1, "a single server (not in a cluster)"
	}
	known := len(p.nc.Servers())
	if known <= 1 || known >= 3 {
		return 3, fmt.Sprintf("cluster %q", cluster)
	}
	return known, fmt.Sprintf("cluster %q of %d servers", cluster, known)
}

// streamConfig is the configuration EnsureStream creates, and why it has
// its replica count.
func (p *Publisher) streamConfig(subjects []string) (jetstream.StreamConfig, string) {
	sp := p.cfg.StreamSpec
	replicas, why := sp.Replicas, "--stream-replicas"
	if replicas == 0 {
		replicas, why = p.AutoReplicas()
	}
	return jetstream.StreamConfig{
		Name:        p.cfg.Stream,
		Description: "transactional outbox, written by jetbox",
		Subjects:    subjects,
		Retention:   jetstream.LimitsPolicy,
		Storage:     sp.Storage,
		Replicas:    replicas,
		MaxAge:      sp.MaxAge,
		MaxBytes:    limit(sp.MaxBytes),
		MaxMsgs:     limit(sp.MaxMsgs),
		Discard:     sp.Discard,
		Duplicates:  p.cfg.DuplicateWindow,
		// A server before 2.12 ignores it: checked by EnsureStream.
		AllowAtomicPublish: p.cfg.Delivery.Atomic(),
	}, why
}

func limit(n int64) int64 {
	if n <= 0 {
		return -1
	}
	return n
}

// DescribeStream says what a stream config holds, as check and the
// start-up log put it.
func DescribeStream(c jetstream.StreamConfig) string {
	return fmt.Sprintf("subjects %q, %s storage, %d replica(s), %s retention, max age %s, max bytes %s, max messages %s, discard %s, duplicate window %s",
		c.Subjects, StorageText(c.Storage), max(c.Replicas, 1), strings.ToLower(c.Retention.String()), ageText(c.MaxAge), limitText(c.MaxBytes), limitText(c.MaxMsgs), DiscardText(c.Discard), c.Duplicates)
}

// StorageText is file or memory, as the flags and the nats CLI write it.
func StorageText(s jetstream.StorageType) string {
	if s == jetstream.MemoryStorage {
		return "memory"
	}
	return "file"
}

// DiscardText is old or new, as the flags and the nats CLI write it.
func DiscardText(d jetstream.DiscardPolicy) string {
	if d == jetstream.DiscardNew {
		return "new"
	}
	return "old"
}

func ageText(d time.Duration) string {
	if d <= 0 {
		return "unlimited"
	}
	return d.String()
}

func limitText(n int64) string {
	if n <= 0 {
		return "unlimited"
	}
	return strconv.FormatInt(n, 10)
}

// Difference is one setting where an existing stream differs from what
// jetbox was told.
type Difference struct {
	Flag      string // e.g. "stream-replicas"
	Stream    string // the stream's value
	Want      string // the flag's value
	EditArg   string // the `nats stream edit` argument that sets it; "" when it cannot be edited
	Immutable bool   // storage: only a new stream changes it
}

// Drift compares an existing stream's config with the settings given
// explicitly (StreamSpec.Given). Replicas in auto mode, and the settings
// not given, are not compared.
func (p *Publisher) Drift(c jetstream.StreamConfig) []Difference {
	sp, g := p.cfg.StreamSpec, p.cfg.StreamSpec.Given
	var d []Difference
	if g["replicas"] && sp.Replicas > 0 && max(c.Replicas, 1) != sp.Replicas {
		d = append(d, Difference{Flag: "stream-replicas", Stream: strconv.Itoa(max(c.Replicas, 1)), Want: strconv.Itoa(sp.Replicas), EditArg: "--replicas " + strconv.Itoa(sp.Replicas)})
	}
	if g["max-age"] && c.MaxAge != sp.MaxAge && !(c.MaxAge <= 0 && sp.MaxAge <= 0) {
		arg := "-1"
		if sp.MaxAge > 0 {
			arg = sp.MaxAge.String()
		}
		d = append(d, Difference{Flag: "stream-max-age", Stream: ageText(c.MaxAge), Want: ageText(sp.MaxAge), EditArg: "--max-age " + arg})
	}
	if g["max-bytes"] && limit(c.MaxBytes) != limit(sp.MaxBytes) {
		d = append(d, Difference{Flag: "stream-max-bytes", Stream: limitText(c.MaxBytes), Want: limitText(sp.MaxBytes), EditArg: "--max-bytes " + strconv.FormatInt(limit(sp.MaxBytes), 10)})
	}
	if g["max-msgs"] && limit(c.MaxMsgs) != limit(sp.MaxMsgs) {
		d = append(d, Difference{Flag: "stream-max-msgs", Stream: limitText(c.MaxMsgs), Want: limitText(sp.MaxMsgs), EditArg: "--max-msgs " + strconv.FormatInt(limit(sp.MaxMsgs), 10)})
	}
	if g["discard"] && c.Discard != sp.Discard {
		d = append(d, Difference{Flag: "stream-discard", Stream: DiscardText(c.Discard), Want: DiscardText(sp.Discard), EditArg: "--discard " + DiscardText(sp.Discard)})
	}
	if g["duplicate-window"] && c.Duplicates != p.cfg.DuplicateWindow {
		d = append(d, Difference{Flag: "duplicate-window", Stream: c.Duplicates.String(), Want: p.cfg.DuplicateWindow.String(), EditArg: "--dupe-window " + p.cfg.DuplicateWindow.String()})
	}
	if g["storage"] && c.Storage != sp.Storage {
		d = append(d, Difference{Flag: "stream-storage", Stream: StorageText(c.Storage), Want: StorageText(sp.Storage), Immutable: true})
	}
	return d
}

// DriftFix is the fix for differences: the `nats stream edit` line for the
// editable ones, and what to do about storage, which no edit changes.
func (p *Publisher) DriftFix(d []Difference) string {
	var args, fixes []string
	for _, x := range d {
		if x.EditArg != "" {
			args = append(args, x.EditArg)
		}
		if x.Immutable {
			fixes = append(fixes, fmt.Sprintf("storage cannot be edited: create a new %s stream (or drop --stream-storage)", x.Want))
		}
	}
	if len(args) > 0 {
		fixes = append([]string{fmt.Sprintf("nats stream edit %s %s (or drop the flags to keep the stream as it is)", p.cfg.Stream, strings.Join(args, " "))}, fixes...)
	}
	return strings.Join(fixes, "; ")
}

// DriftText says what differs, in one line.
func DriftText(stream string, d []Difference) string {
	parts := make([]string, len(d))
	for i, x := range d {
		parts[i] = fmt.Sprintf("--%s %s, the stream has %s", x.Flag, x.Want, x.Stream)
	}
	return fmt.Sprintf("stream %q differs from the flags given (jetbox does not change an existing stream): %s", stream, strings.Join(parts, "; "))
}

// createError adds the fix to a failed create the flags can fix.
func (p *Publisher) createError(err error, c jetstream.StreamConfig, why string) error {
	var api *jetstream.APIError
	if !errors.As(err, &api) {
		return err
	}
	switch api.ErrorCode {
	case 10074: // JSStreamReplicasNotSupportedErr: replicas > 1 on a single server
		return fmt.Errorf("%w: a single server holds only 1 replica: set --stream-replicas=1, or connect to a JetStream cluster", err)
	case 10005, 10023: // JSClusterNoPeersErr, JSInsufficientResourcesErr
		return fmt.Errorf("%w: the cluster cannot place %d replicas (%s): set --stream-replicas to what it can hold (e.g. --stream-replicas=1), or check that every server is up and has JetStream storage left",
			err, c.Replicas, why)
	case 10113: // JSStreamMaxBytesRequired
		return fmt.Errorf("%w: the account requires a byte limit: set --stream-max-bytes (e.g. 10GiB)", err)
	}
	return err
}
