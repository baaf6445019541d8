package main

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/jetbox-dev/jetbox/replication"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/jetbox-dev/jetbox/sink/format"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
)

// Config is the validated configuration of `jetbox run`.
type Config struct {
	PostgresURL string
	// StandbyURLs are the standbys watched for the slot's copy (--standby-urls).
	StandbyURLs []string
	NatsURL     string
	NATS        NATSAuth
	// NatsListen and NatsStoreDir configure the embedded server (--nats-url=embedded).
	NatsListen, NatsStoreDir string
	HTTPAddr                 string
	MaxOutage                time.Duration
	// FinalScrapeWait: after a stop on an invalid row, serve /metrics until
	// it is scraped once more, at most this long (--final-scrape-wait).
	FinalScrapeWait time.Duration
	Replication     replication.Config
	Sink            sink.Config
	LogLevel        zerolog.Level
	LogConsole      bool
	Metrics         *metrics.Metrics // set by run
	// Audit is the continuous audit of jetbox run (--audit-interval).
	Audit AuditLoopConfig
	// LostSlot is what jetbox run does on a lost slot (--on-lost-slot).
	LostSlot LostSlotConfig
}

// LostSlotConfig configures jetbox run's answer to a lost slot.
type LostSlotConfig struct {
	// Repair: run jetbox repair's steps and go on streaming
	// (--on-lost-slot=repair); false: stop with exit 2.
	Repair bool
	// Margin is the repair's overlap (--on-lost-slot-margin).
	Margin time.Duration
}

// AuditLoopConfig configures the continuous audit (auditloop.go).
type AuditLoopConfig struct {
	Interval, Grace, Margin time.Duration // Interval 0: off
	PageSize                int
	CreatedAtColumn         string
}

// NATSAuth is how jetbox authenticates to NATS and verifies it.
type NATSAuth struct {
	Creds, NKey, User, Password, Token string
	TLSCA, TLSCert, TLSKey             string
	TLSFirst                           bool   // TLS before the server's INFO (a context's tls_first)
	UserJWT, UserSeed                  string // a context's user_jwt and user_seed
	InboxPrefix                        string // the reply subjects' prefix (nats.CustomInboxPrefix)
	// Name is the connection's name in the server's reports:
	// jetbox/<slot>/<hostname>, so instances can be told apart.
	Name string
}

// ConfigError is one invalid setting, with how to fix it.
type ConfigError struct {
	Flag, Env, Value string
	Problem          string
	Hint             string
}

func (e *ConfigError) Error() string {
	s := fmt.Sprintf("--%s (%s)", e.Flag, e.Env)
	if e.Value != "" {
		s += fmt.Sprintf(" = %q", e.Value)
	}
	return s + ": " + e.Problem + "; fix: " + e.Hint
}

var (
	slotName   = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)
	streamName = regexp.MustCompile(`^[^\s.*>/\\]{1,255}$`)
	identName  = regexp.MustCompile(`^.{1,63}$`)
)

// Config validates the flags and returns every problem at once, joined.
func (f *RunFlags) Config() (Config, error) {
	p := &problems{}
	n := f.natsFlags(p.bad)
	c := Config{PostgresURL: f.PostgresURL, NatsURL: n.URL, HTTPAddr: f.HTTPAddr, NATS: NATSAuth{
		Creds: n.Creds, NKey: n.NKey, User: n.User, Password: n.Password, Token: n.Token,
		TLSCA: n.TLSCA, TLSCert: n.TLSCert, TLSKey: n.TLSKey, TLSFirst: n.TLSFirst, UserJWT: n.UserJWT, UserSeed: n.UserSeed,
		InboxPrefix: n.InboxPrefix, Name: connectionName(f.Slot)}}
	f.checkNATS(n, p.bad)
	f.checkServers(p.bad)
	c.StandbyURLs = standbyURLs(f.StandbyURLs, p.bad)
	if f.NatsURL == "embedded" {
		c.NatsListen, c.NatsStoreDir = f.NatsListen, f.NatsStoreDir
	}
	schema, table := f.checkNames(p.bad)
	fromTable, messagePrefix := f.sources(p.bad)
	subjects := f.subjects(p.bad)
	cols := f.columns(p.bad)
	t := f.timings(p)
	c.MaxOutage = t.maxOutage
	c.FinalScrapeWait = p.dur("final-scrape-wait", f.FinalScrape, 0, 10*time.Minute)
	c.Audit = f.auditLoop(p, fromTable)
	delivery := f.delivery(p.bad)
	spec, dupWindow := f.streamSpec(p.bad, p.dur, delivery, t.publish, c.MaxOutage)
	l := f.limits(p.bad)
	acceptLost := p.boolean("accept-lost-rows", f.AcceptLostRows)
	c.LostSlot = f.lostSlot(p, acceptLost, fromTable, messagePrefix != "")
	allowRouting := p.boolean("allow-routing-change", f.AllowRouting)
	deadLetter := f.deadLetterSubject(p.bad)
	level := f.logging(p.bad)
	standbySlots := f.standbySlots(p, f.Slot)
	if err := p.err(); err != nil {
		return Config{}, err
	}

	if !fromTable {
		schema, table = "", "" // no table: the decoder publishes no rows
	}
	filter := f.SubjectPrefix + ".*.*" // the default template's subjects
	if subjects != nil {
		filter = subjects.Filter(f.SubjectPrefix)
	}
	c.Replication = replication.Config{
		Slot: f.Slot, Publication: f.Publication,
		Decoder: decoder.Config{Schema: schema, Table: table, Columns: cols, SubjectPrefix: f.SubjectPrefix, DeadLetterSubject: deadLetter,
			Subjects: subjects, MessagePrefix: messagePrefix, Atomic: delivery.Atomic()},
		StatusInterval:     t.status,
		Timeout:            t.postgres,
		MaxInFlight:        l.inFlight,
		MaxInFlightBytes:   l.inFlightBytes,
		ShutdownTimeout:    t.shutdown,
		StandbyRetry:       t.standbyRetry,
		HeartbeatInterval:  t.heartbeat,
		MaxRetainedWAL:     l.retainedWAL,
		MonitorInterval:    t.monitor,
		AcceptLostRows:     acceptLost,
		AutoRepair:         c.LostSlot.Repair,
		AllowRoutingChange: allowRouting,
		PrimaryURL:         f.PrimaryURL,
		CreatedAtColumn:    f.CreatedAtColumn,
		StandbySlots:       standbySlots,
	}
	c.Sink = sink.Config{Stream: f.Stream, SubjectPrefix: f.SubjectPrefix, DuplicateWindow: dupWindow, StreamSpec: spec,
		PublishTimeout: t.publish, MaxPending: l.inFlight, MaxControlLine: l.controlLine, Delivery: delivery, DeadLetterSubject: deadLetter,
		SubjectFilter: filter, SubjectsHoldIDs: subjects != nil && subjects.UsesAggregateID(),
		IndexScheme: c.Replication.Decoder.IndexScheme(), JSDomain: n.JSDomain, Routing: c.Replication.Decoder.RoutingHeader()}
	c.LogLevel, c.LogConsole = level, f.LogFormat == "console"
	return c, nil
}

// lostSlot reads --on-lost-slot and its margin. repair needs rows to
// re-read (a table, and no messages: those exist only in the WAL) and
// excludes --accept-lost-rows, which goes on past the loss instead.
func (f *RunFlags) lostSlot(p *problems, acceptLost, fromTable, fromMessages bool) LostSlotConfig {
	var c LostSlotConfig
	switch f.OnLostSlot {
	case "stop":
	case "repair":
		c.Repair = true
		if acceptLost {
			p.bad("on-lost-slot", f.OnLostSlot, "--on-lost-slot=repair and --accept-lost-rows exclude each other (one repairs the loss, the other accepts it)", "give one of them")
		}
		if !fromTable || fromMessages {
			p.bad("on-lost-slot", f.OnLostSlot, "repair re-publishes rows of the outbox table, and logical decoding messages (--source with messages) exist only in the WAL: the ones a lost slot did not stream cannot be re-read",
				"use --on-lost-slot=stop with --source including messages (after a loss have the producers emit the events again, see docs/routing.md)")
		}
	default:
		p.bad("on-lost-slot", f.OnLostSlot, "unknown value", "use stop or repair")
	}
	c.Margin = p.dur("on-lost-slot-margin", f.LostSlotMargin, 0, 0)
	return c
}

// problems collects the configuration problems of one validation.
type problems struct{ errs []error }

// bad records that flag's value has problem, and the fix.
func (p *problems) bad(flag, value, problem, fix string) {
	p.errs = append(p.errs, &ConfigError{Flag: flag, Env: envName(flag), Value: value, Problem: problem, Hint: fix})
}

// dur reads flag's duration, within [min, max] (max 0: no bound).
func (p *problems) dur(flag string, v durationFlag, min, max time.Duration) time.Duration {
	if v.failed() {
		p.bad(flag, v.Text, "not a duration", "use a Go duration such as 500ms, 30s or 2m")
		return 0
	}
	if v.Value < min || (max > 0 && v.Value > max) {
		p.bad(flag, v.Text, "out of range", fmt.Sprintf("use a value between %s and %s", min, max))
	}
	return v.Value
}

// boolean reads a boolean flag.
func (p *problems) boolean(flag string, v boolFlag) bool {
	if v.failed() {
		p.bad(flag, v.Text, "not a boolean", "use true or false")
		return false
	}
	return v.Value
}

// err is every problem, joined; nil when there is none.
func (p *problems) err() error { return errors.Join(p.errs...) }

// checkNATS checks the NATS credentials, TLS files and URLs (from the
// flags and --nats-context, n).
func (f *RunFlags) checkNATS(n natsFlags, bad func(flag, value, problem, fix string)) {
	checkNATSNames(n, f.NatsContext, bad)
	kinds := 0
	for _, set := range []bool{f.NatsCreds != "", f.NatsNKey != "", f.NatsUser != "", f.NatsToken != ""} {
		if set {
			kinds++
		}
	}
	if kinds > 1 {
		bad("nats-creds", "", "more than one NATS credential kind given (creds, nkey, user/password, token)", "pass exactly one of them")
	}
	if (n.User == "") != (n.Password == "") {
		if n.fromContext["nats-user"] || n.fromContext["nats-password"] {
			bad("nats-context", f.NatsContext, "the user and the password (from the context and --nats-user/--nats-password) go together", "give both, or neither")
		} else {
			bad("nats-user", f.NatsUser, "--nats-user and --nats-password go together", "give both, or neither")
		}
	}
	if (n.TLSCert == "") != (n.TLSKey == "") {
		if n.fromContext["nats-tls-cert"] || n.fromContext["nats-tls-key"] {
			bad("nats-context", f.NatsContext, "the context's cert and key go together", "give both in the context, or --nats-tls-cert and --nats-tls-key")
		} else {
			bad("nats-tls-cert", f.NatsTLSCert, "--nats-tls-cert and --nats-tls-key go together", "give both, or neither")
		}
	}
	for flag, path := range map[string]string{"nats-creds": n.Creds, "nats-nkey": n.NKey, "nats-tls-ca": n.TLSCA, "nats-tls-cert": n.TLSCert, "nats-tls-key": n.TLSKey} {
		if path == "" {
			continue
		}
		if _, err := os.Stat(path); err != nil {
			if n.fromContext[flag] {
				bad("nats-context", f.NatsContext, "its "+strings.TrimPrefix(flag, "nats-")+" file: cannot read it: "+err.Error(), "check the path in the context and the permissions")
			} else {
				bad(flag, path, "cannot read the file: "+err.Error(), "check the path and permissions")
			}
		}
	}
	if f.NatsURL == "embedded" {
		if f.NatsStoreDir == "" {
			bad("nats-store-dir", "", "required with --nats-url=embedded", "give a persistent directory for the embedded server's JetStream store")
		}
		if _, _, err := net.SplitHostPort(f.NatsListen); err != nil {
			bad("nats-listen", f.NatsListen, "not host:port", "use e.g. 127.0.0.1:4222")
		}
		return
	}
	for _, u := range strings.Split(n.URL, ",") {
		u = strings.TrimSpace(u)
		pu, err := url.Parse(u)
		if err != nil || pu.Host == "" || !map[string]bool{"nats": true, "tls": true, "ws": true, "wss": true}[pu.Scheme] {
			if n.fromContext["nats-url"] {
				bad("nats-context", f.NatsContext, "its url "+redact(u)+" is not a NATS URL", "fix the context's url, or give --nats-url")
			} else {
				bad("nats-url", u, "not a NATS URL", "use nats://host:4222 (or tls://, ws://, wss://; or embedded); separate several with commas")
			}
		}
	}
}

// checkServers checks the Postgres URLs and the HTTP address.
func (f *RunFlags) checkServers(bad func(flag, value, problem, fix string)) {
	if f.HTTPAddr != "" {
		if _, _, err := net.SplitHostPort(f.HTTPAddr); err != nil {
			bad("http-addr", f.HTTPAddr, "not host:port", "use e.g. 127.0.0.1:8080 or :8080, or empty to disable")
		}
	}
	if f.PostgresURL == "" {
		bad("postgres-url", "", "required", "set JETBOX_POSTGRES_URL, e.g. postgres://jetbox:secret@127.0.0.1:5432/app?sslmode=disable")
	} else if _, err := pgconn.ParseConfig(f.PostgresURL); err != nil {
		bad("postgres-url", "", "cannot be parsed: "+redact(err.Error()), "use a libpq URL (postgres://user:pass@host:5432/db) or a key=value DSN")
	}
	if f.PrimaryURL != "" {
		if _, err := pgconn.ParseConfig(f.PrimaryURL); err != nil {
			bad("primary-url", "", "cannot be parsed: "+redact(err.Error()), "use a libpq URL (postgres://user:pass@primary:5432/db) or a key=value DSN, the same database as --postgres-url")
		}
	}
}

// checkNames checks the table, slot, publication, stream and subject
// prefix names; it returns the table's schema and name.
func (f *RunFlags) checkNames(bad func(flag, value, problem, fix string)) (schema, table string) {
	schema, table, ok := strings.Cut(f.Table, ".")
	if !ok {
		schema, table = "public", f.Table
	}
	if schema == "" || table == "" || strings.Contains(table, ".") || !identName.MatchString(schema) || !identName.MatchString(table) {
		bad("table", f.Table, "not a table name", "use schema.table as stored in the catalog, e.g. public.outbox")
	}
	if !slotName.MatchString(f.Slot) {
		bad("slot", f.Slot, "not a valid slot name", "use 1-63 lower-case letters, digits and underscores")
	}
	if !identName.MatchString(f.Publication) {
		bad("publication", f.Publication, "not a valid publication name", "use 1-63 characters")
	}
	if !streamName.MatchString(f.Stream) {
		bad("stream", f.Stream, "not a valid stream name", "use letters, digits, '-' or '_' (no spaces, '.', '*', '>', '/')")
	}
	if err := decoder.ValidPrefix(f.SubjectPrefix); err != nil {
		bad("subject-prefix", f.SubjectPrefix, err.Error(), "use dot-separated tokens without spaces or wildcards, e.g. outbox or acme.outbox")
	}
	return schema, table
}

// sources reads --source: whether the table is a source, and the prefix of
// outbox messages ("" when messages are not one).
func (f *RunFlags) sources(bad func(flag, value, problem, fix string)) (fromTable bool, messagePrefix string) {
	fromMessages := false
	for _, src := range strings.Split(f.Source, ",") {
		switch strings.TrimSpace(src) {
		case "table":
			if fromTable {
				bad("source", f.Source, "table is given twice", "use table, messages or table,messages")
			}
			fromTable = true
		case "messages":
			if fromMessages {
				bad("source", f.Source, "messages is given twice", "use table, messages or table,messages")
			}
			fromMessages = true
		default:
			bad("source", f.Source, fmt.Sprintf("unknown source %q", strings.TrimSpace(src)), "use table, messages or table,messages")
		}
	}
	if fromMessages {
		messagePrefix = f.MessagePrefix
		if err := decoder.ValidMessagePrefix(f.MessagePrefix); err != nil {
			bad("message-prefix", f.MessagePrefix, err.Error(), "use the prefix your producers pass to pg_logical_emit_message: printable, without \"Nats-\" or spaces at the ends, at most "+strconv.Itoa(decoder.MaxMessagePrefix)+" bytes, e.g. jetbox (the default)")
		}
	}
	return fromTable, messagePrefix
}

// subjects reads --subject-template and --partitions: the template, nil for
// the default one (which keeps the historical subject code and hints).
// The template's syntax and the partition count are checked apart, so
// both problems are reported, each under its own flag; --partitions is
// blamed only for not matching the template's {partition}.
func (f *RunFlags) subjects(bad func(flag, value, problem, fix string)) *decoder.Template {
	badPartitions := f.Partitions.failed() || f.Partitions.Value < 0 || f.Partitions.Value > 100000
	if badPartitions {
		bad("partitions", f.Partitions.Text, "not a count between 0 and 100000", "use 0 (no {partition}) or e.g. 16")
	}
	hasPartition := strings.Contains(f.SubjectTemplate, decoder.TokenPartition)
	syntaxN := 0
	if hasPartition {
		syntaxN = 1
	}
	if _, err := decoder.ParseTemplate(f.SubjectTemplate, syntaxN); err != nil {
		bad("subject-template", f.SubjectTemplate, err.Error(), "write tokens separated by '.', {prefix} first, e.g. {prefix}.{aggregate_type}.{partition}.{event_type} with --partitions=16 (see docs/routing.md)")
		return nil
	}
	if badPartitions {
		return nil
	}
	tpl, err := decoder.ParseTemplate(f.SubjectTemplate, int(f.Partitions.Value))
	if err != nil {
		flag, value := "partitions", f.Partitions.Text
		if hasPartition {
			flag, value = "subject-template", f.SubjectTemplate // {partition} without a count
		}
		bad(flag, value, err.Error(), "give --partitions=N (N ≥ 1) exactly when the template has {partition}, e.g. {prefix}.{aggregate_type}.{partition}.{event_type} with --partitions=16")
		return nil
	}
	if f.SubjectTemplate == decoder.DefaultSubjectTemplate {
		return nil
	}
	return tpl
}

// columns reads the --*-column flags: each role its own column.
func (f *RunFlags) columns(bad func(flag, value, problem, fix string)) decoder.Columns {
	cols := decoder.Columns{ID: f.IDColumn, AggregateType: f.AggregateTypeColumn, AggregateID: f.AggregateIDColumn,
		EventType: f.EventTypeColumn, Payload: f.PayloadColumn, Headers: f.HeadersColumn}
	seen := map[string]string{}
	for _, fc := range []struct{ flag, col string }{{"id-column", cols.ID}, {"aggregate-type-column", cols.AggregateType},
		{"aggregate-id-column", cols.AggregateID}, {"event-type-column", cols.EventType},
		{"payload-column", cols.Payload}, {"headers-column", cols.Headers}} {
		switch other, dup := seen[fc.col]; {
		case fc.col == "" && fc.flag != "headers-column":
			bad(fc.flag, "", "empty", "name the column")
		case fc.col != "" && dup:
			bad(fc.flag, fc.col, "the same column as --"+other, "give each role its own column")
		}
		seen[fc.col] = fc.flag
	}
	return cols
}

// timings are the periods and timeouts of the flags.
type timings struct {
	publish, status, postgres, shutdown, standbyRetry, heartbeat, monitor, maxOutage time.Duration
}

// timings reads the duration flags and checks them against each other.
func (f *RunFlags) timings(p *problems) timings {
	t := timings{
		// Below the 2-minute bound jetbox waits for a session's acks before republishing.
		publish:      p.dur("publish-timeout", f.PublishTimeout, 100*time.Millisecond, 90*time.Second),
		status:       p.dur("status-interval", f.StatusInterval, 10*time.Millisecond, 10*time.Second),
		postgres:     p.dur("postgres-timeout", f.PostgresTimeout, time.Second, 10*time.Minute),
		shutdown:     p.dur("shutdown-timeout", f.ShutdownTimeout, 0, 10*time.Minute),
		standbyRetry: p.dur("standby-retry", f.StandbyRetry, 50*time.Millisecond, time.Minute),
		heartbeat:    p.dur("heartbeat-interval", f.Heartbeat, 0, time.Hour),
		maxOutage:    p.dur("max-outage", f.MaxOutage, 0, 0),
	}
	if t.heartbeat > 0 && t.heartbeat < time.Second {
		p.bad("heartbeat-interval", f.Heartbeat.Text, "shorter than 1s", "use 0 (off) or e.g. 10s")
	}
	t.monitor = p.dur("monitor-interval", f.MonitorInterval, 100*time.Millisecond, time.Hour)
	if t.status > 0 && t.postgres > 0 && t.postgres < 3*t.status {
		p.bad("postgres-timeout", f.PostgresTimeout.Text, "shorter than 3 status intervals", "raise --postgres-timeout or lower --status-interval")
	}
	return t
}

// standbySlots reads --wait-for-standby-slots and its timeout and policy.
func (f *RunFlags) standbySlots(p *problems, slot string) replication.StandbySlotsConfig {
	var c replication.StandbySlotsConfig
	names, err := replication.ParseStandbySlots(f.WaitSlots)
	if err != nil {
		p.bad("wait-for-standby-slots", f.WaitSlots, err.Error(), "give the physical slot names of the standbys, comma-separated (SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'physical' on the primary)")
	}
	for _, n := range names {
		if n == slot {
			p.bad("wait-for-standby-slots", f.WaitSlots, fmt.Sprintf("names jetbox's own logical slot %q", n), "name the standbys' physical slots, not --slot")
		}
	}
	c.Slots = names
	c.Timeout = p.dur("standby-slot-timeout", f.StandbySlotWait, 100*time.Millisecond, time.Hour)
	switch f.OnStandbySlot {
	case replication.StandbySlotWait, replication.StandbySlotPublish:
		c.OnTimeout = f.OnStandbySlot
	default:
		p.bad("on-standby-slot-timeout", f.OnStandbySlot, "unknown policy", "use wait (the default: nothing a promoted standby may lack is published) or publish (go on without the guarantee)")
	}
	return c
}

// auditLoop reads the continuous audit's flags.
func (f *RunFlags) auditLoop(p *problems, fromTable bool) AuditLoopConfig {
	a := AuditLoopConfig{Interval: p.dur("audit-interval", f.AuditInterval, 0, 24*time.Hour), Grace: p.dur("audit-grace", f.AuditGrace, 0, 24*time.Hour),
		Margin: p.dur("audit-margin", f.AuditMargin, 0, 24*time.Hour), PageSize: 10_000, CreatedAtColumn: f.CreatedAtColumn}
	if a.Interval > 0 && a.Interval < time.Second {
		p.bad("audit-interval", f.AuditInterval.Text, "shorter than 1s", "use 0 (off) or e.g. 1h")
	}
	if a.Interval > 0 && !fromTable {
		p.bad("audit-interval", f.AuditInterval.Text, "the audit compares the outbox table's rows with the stream, and --source=messages has no table",
			"drop --audit-interval (0), or audit a table source")
	}
	return a
}

// windowLimits are the sizes of the flags.
type windowLimits struct {
	inFlight, inFlightBytes, controlLine int
	retainedWAL                          int64
}

// limits reads the count and size flags.
func (f *RunFlags) limits(bad func(flag, value, problem, fix string)) windowLimits {
	var l windowLimits
	if f.MaxRetainedWAL.failed() {
		bad("max-retained-wal", f.MaxRetainedWAL.Text, "not a size", "use e.g. 1GiB, or 0 to disable")
	}
	l.retainedWAL = f.MaxRetainedWAL.Value
	if n := f.MaxInFlight; n.failed() || n.Value < 1 || n.Value > 100000 {
		bad("max-in-flight", n.Text, "not a count between 1 and 100000", "use e.g. 1024")
	} else {
		l.inFlight = int(n.Value)
	}
	if n := f.NatsMaxCtlLine; n.failed() || n.Value < 256 || n.Value > 1<<24 {
		bad("nats-max-control-line", n.Text, "not a size between 256 and 16777216 bytes", "use the server's max_control_line (nats-server's default: 4096)")
	} else {
		l.controlLine = int(n.Value)
	}
	if b := f.MaxInFlightBytes; b.failed() || b.Value < 1024 {
		bad("max-in-flight-bytes", b.Text, "not a size of at least 1KiB", "use e.g. 8MiB")
	} else {
		l.inFlightBytes = int(b.Value)
	}
	return l
}

// deadLetterSubject reads --on-invalid and --dead-letter-subject: where
// dead letters go, "" with --on-invalid=stop.
func (f *RunFlags) deadLetterSubject(bad func(flag, value, problem, fix string)) string {
	switch f.OnInvalid {
	case "stop":
		if f.DeadLetterSubj != "" {
			bad("dead-letter-subject", f.DeadLetterSubj, "set while --on-invalid=stop, so never used", "add --on-invalid=dead-letter, or drop --dead-letter-subject")
		}
		return ""
	case "dead-letter":
		deadLetter := f.DeadLetterSubj
		if deadLetter == "" {
			deadLetter = format.DefaultDeadLetterSubject(f.SubjectPrefix)
		}
		if err := decoder.ValidPrefix(deadLetter); err != nil {
			bad("dead-letter-subject", deadLetter, err.Error(), "use dot-separated tokens without spaces or wildcards, e.g. outbox._dlq")
		} else if rest, under := strings.CutPrefix(deadLetter, f.SubjectPrefix+"."); under && !strings.HasPrefix(rest, "_") {
			bad("dead-letter-subject", deadLetter, "inside the event subjects: it would collide with aggregate type "+strings.Split(rest, ".")[0],
				"start the token after the prefix with '_' (e.g. "+format.DefaultDeadLetterSubject(f.SubjectPrefix)+") or use a subject outside "+f.SubjectPrefix+".>")
		}
		return deadLetter
	}
	bad("on-invalid", f.OnInvalid, "unknown policy", "use stop or dead-letter (see docs/guarantees.md)")
	return ""
}

// logging reads --log-level and --log-format.
func (f *RunFlags) logging(bad func(flag, value, problem, fix string)) zerolog.Level {
	level, err := zerolog.ParseLevel(f.LogLevel)
	if err != nil || f.LogLevel == "" {
		bad("log-level", f.LogLevel, "unknown level", "use debug, info, warn or error")
	}
	if f.LogFormat != "json" && f.LogFormat != "console" {
		bad("log-format", f.LogFormat, "unknown format", "use json or console")
	}
	return level
}

// delivery reads --delivery, --order-guard and --atomic-transactions into
// one of the four delivery modes, reporting every value and combination
// that is not one. An unknown --delivery counts as exactly-once for the
// other checks (any value but dedup did before the mode was parsed).
func (f *RunFlags) delivery(bad func(flag, value, problem, fix string)) sink.Delivery {
	if f.Delivery != "dedup" && f.Delivery != "exactly-once" {
		bad("delivery", f.Delivery, "unknown delivery mode", "use dedup or exactly-once (see docs/guarantees.md)")
	}
	orderGuard := f.OrderGuard.Value && !f.OrderGuard.failed()
	if f.OrderGuard.failed() {
		bad("order-guard", f.OrderGuard.Text, "not a boolean", "use true or false")
	} else if !orderGuard && f.Delivery == "exactly-once" {
		bad("order-guard", f.OrderGuard.Text, "conflicts with --delivery=exactly-once (the default), which always guards the order", "drop --order-guard=false, or add --delivery=dedup (for a stream shared with other publishers)")
	}
	atomicTx := f.AtomicTx.Value && !f.AtomicTx.failed()
	if f.AtomicTx.failed() {
		bad("atomic-transactions", f.AtomicTx.Text, "not a boolean", "use true or false")
	} else if atomicTx && f.Delivery != "exactly-once" {
		bad("atomic-transactions", f.AtomicTx.Text, "needs --delivery=exactly-once: JetStream refuses a whole atomic batch that holds an id it already stored, so replays must be skipped by position, not deduplicated",
			"add --delivery=exactly-once (jetbox must then be the stream's only writer), or drop --atomic-transactions")
	}
	switch {
	case f.Delivery == "dedup" && orderGuard:
		return sink.DedupGuarded
	case f.Delivery == "dedup":
		return sink.Dedup
	case atomicTx:
		return sink.ExactlyOnceAtomic
	}
	return sink.ExactlyOnce
}

// streamSpec reads the --stream-* flags and --duplicate-window: what a
// stream jetbox creates gets, and which settings were given (compared with
// an existing stream). Empty, or auto where there is a choice, is the default.
func (f *RunFlags) streamSpec(bad func(flag, value, problem, fix string), dur func(flag string, v durationFlag, min, max time.Duration) time.Duration,
	delivery sink.Delivery, publishTimeout, maxOutage time.Duration) (sink.StreamSpec, time.Duration) {
	sp := sink.StreamSpec{Given: map[string]bool{}, MaxBytes: -1, MaxMsgs: -1}
	given := func(key, v string) bool {
		if v == "" || v == "auto" {
			return false
		}
		sp.Given[key] = true
		return true
	}
	if n := f.StreamReplicas; given("replicas", n.Text) {
		if n.failed() || n.Value < 1 || n.Value > 5 {
			bad("stream-replicas", n.Text, "not a replica count between 1 and 5", "use auto (3 on a cluster, 1 on a single server), 1 or 3")
		} else {
			sp.Replicas = int(n.Value)
		}
	}
	if given("max-age", f.StreamMaxAge.Text) {
		sp.MaxAge = dur("stream-max-age", f.StreamMaxAge, 0, 0)
		if sp.MaxAge > 0 && sp.MaxAge < time.Second {
			bad("stream-max-age", f.StreamMaxAge.Text, "shorter than 1s", "use 0 (no max age) or e.g. 168h")
		} else if sp.MaxAge > 0 && delivery.ExactlyOnce() && sp.MaxAge < maxOutage {
			bad("stream-max-age", f.StreamMaxAge.Text, fmt.Sprintf("shorter than --max-outage %s: exactly-once resumes from the stream's last message, which this max age expires during such an outage", maxOutage),
				"drop --stream-max-age (no max age), keep it far above --max-outage, or add --delivery=dedup")
		}
	}
	// limit: a limit is given, and is not -1 or 0 (none).
	limit := func(key, v string) bool { return given(key, v) && v != "-1" && v != "0" }
	if b := f.StreamMaxBytes; limit("max-bytes", b.Text) {
		if b.failed() || b.Value < 1024 {
			bad("stream-max-bytes", b.Text, "not a size of at least 1KiB", "use e.g. 50GiB, or -1 for no limit")
		} else {
			sp.MaxBytes = b.Value
		}
	}
	if n := f.StreamMaxMsgs; limit("max-msgs", n.Text) {
		if n.failed() || n.Value < 1 {
			bad("stream-max-msgs", n.Text, "not a message count", "use e.g. 10000000, or -1 for no limit")
		} else {
			sp.MaxMsgs = n.Value
		}
	}
	if given("storage", f.StreamStorage) {
		switch f.StreamStorage {
		case "file":
		case "memory":
			sp.Storage = jetstream.MemoryStorage
		default:
			bad("stream-storage", f.StreamStorage, "unknown storage", "use file or memory")
		}
	}
	if given("discard", f.StreamDiscard) {
		switch f.StreamDiscard {
		case "old":
		case "new":
			sp.Discard = jetstream.DiscardNew
		default:
			bad("stream-discard", f.StreamDiscard, "unknown discard policy", "use old or new")
		}
	}
	var window time.Duration
	if given("duplicate-window", f.DuplicateWindow.Text) {
		window = dur("duplicate-window", f.DuplicateWindow, time.Second, 0)
		if sp.MaxAge > 0 && window > sp.MaxAge {
			bad("duplicate-window", f.DuplicateWindow.Text, fmt.Sprintf("longer than --stream-max-age %s (JetStream refuses it)", sp.MaxAge), "use a window no longer than the max age")
		}
	} else {
		window = sink.DuplicateWindowFor(delivery.ExactlyOnce(), publishTimeout, maxOutage)
		if sp.MaxAge > 0 && window > sp.MaxAge {
			window = sp.MaxAge // as JetStream caps it
		}
	}
	return sp, window
}

func envName(flag string) string {
	return "JETBOX_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

var passwordInURL = regexp.MustCompile(`(://[^:/@]*:)[^@]*@`)

// redact hides passwords that parse errors may echo.
func redact(s string) string {
	s = passwordInURL.ReplaceAllString(s, "${1}xxxxx@")
	return regexp.MustCompile(`password=\S+`).ReplaceAllString(s, "password=xxxxx")
}
