package main

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/jetbox-dev/jetbox/internal/testenv"
	"go.yaml.in/yaml/v3"
)

// helmVersion is the Helm release the chart is rendered with; .ci/run builds
// it from the Go module proxy into the same cache directory.
const helmVersion = "v3.21.4"

const chartDir = repoRoot + "/deploy/helm/jetbox"

// helmBin finds the helm binary: $JETBOX_HELM_BIN, the cache .ci/run fills,
// then PATH. Missing, the test skips, or fails under JETBOX_REQUIRE_SERVERS=1.
func helmBin(t *testing.T) string {
	t.Helper()
	cands := []string{os.Getenv("JETBOX_HELM_BIN")}
	cache := os.Getenv("JETBOX_HELM_CACHE")
	if cache == "" {
		cache = "/var/tmp/jetbox-helm"
	}
	cands = append(cands, filepath.Join(cache, helmVersion, "helm"))
	if p, err := exec.LookPath("helm"); err == nil {
		cands = append(cands, p)
	}
	for _, c := range cands {
		if c == "" {
			continue
		}
		if fi, err := os.Stat(c); err == nil && !fi.IsDir() {
			return c
		}
	}
	msg := "no helm binary: GOBIN=/var/tmp/jetbox-helm/" + helmVersion + " go install helm.sh/helm/v3/cmd/helm@" + helmVersion + " (as .ci/run does), or set JETBOX_HELM_BIN"
	if testenv.RequireServers() {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return ""
}

// helmTemplate renders the chart with the given values files and --set
// arguments, for a Kubernetes version the chart supports.
func helmTemplate(t *testing.T, helm string, args ...string) ([]map[string]any, error) {
	t.Helper()
	cmd := exec.Command(helm, append([]string{"template", "jetbox", chartDir, "--namespace", "apps", "--kube-version", "1.30.0"}, args...)...)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+t.TempDir(), "HELM_CONFIG_HOME="+t.TempDir(), "HELM_DATA_HOME="+t.TempDir())
	if err := cmd.Run(); err != nil {
		return nil, errors.New(strings.TrimSpace(stderr.String()))
	}
	var docs []map[string]any
	dec := yaml.NewDecoder(&out)
	for {
		var d map[string]any
		err := dec.Decode(&d)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("helm template %v: output is not YAML: %v", args, err)
		}
		if d != nil {
			docs = append(docs, d)
		}
	}
	return docs, nil
}

// k8s mirrors the parts of the rendered objects the test reads.
type k8sObject struct {
	Kind     string
	Metadata struct {
		Name   string
		Labels map[string]string
	}
	Spec struct {
		Replicas    *int
		ServiceName string `yaml:"serviceName"`
		Selector    struct {
			MatchLabels map[string]string `yaml:"matchLabels"`
		}
		SelectorMap map[string]string `yaml:"-"`
		Strategy    struct {
			Type          string
			RollingUpdate map[string]any `yaml:"rollingUpdate"`
		}
		Template struct {
			Metadata struct{ Labels map[string]string }
			Spec     podSpec
		}
		// Service
		PublishNotReadyAddresses bool `yaml:"publishNotReadyAddresses"`
		Ports                    []struct {
			Name       string
			Port       int
			TargetPort any `yaml:"targetPort"`
		}
		// PodDisruptionBudget
		MaxUnavailable any `yaml:"maxUnavailable"`
		MinAvailable   any `yaml:"minAvailable"`
		// ServiceMonitor
		Endpoints []struct{ Port, Path string }
		// PrometheusRule
		Groups []any
	}
}

type podSpec struct {
	SecurityContext map[string]any `yaml:"securityContext"`
	Containers      []container
	Volumes         []struct {
		Name   string
		Secret *struct {
			SecretName string `yaml:"secretName"`
			Items      []struct{ Key, Path string }
		}
		EmptyDir map[string]any `yaml:"emptyDir"`
	}
}

type container struct {
	Name string
	Args []string
	Env  []struct {
		Name      string
		Value     *string
		ValueFrom *struct {
			SecretKeyRef *struct{ Name, Key string } `yaml:"secretKeyRef"`
		} `yaml:"valueFrom"`
	}
	Ports []struct {
		Name          string
		ContainerPort int `yaml:"containerPort"`
	}
	LivenessProbe struct {
		HTTPGet struct{ Path, Port string } `yaml:"httpGet"`
	} `yaml:"livenessProbe"`
	ReadinessProbe struct {
		HTTPGet struct{ Path, Port string } `yaml:"httpGet"`
	} `yaml:"readinessProbe"`
	Resources       struct{ Requests, Limits map[string]string }
	SecurityContext struct {
		RunAsNonRoot             *bool `yaml:"runAsNonRoot"`
		RunAsUser                *int  `yaml:"runAsUser"`
		ReadOnlyRootFilesystem   *bool `yaml:"readOnlyRootFilesystem"`
		AllowPrivilegeEscalation *bool `yaml:"allowPrivilegeEscalation"`
		Capabilities             struct{ Drop []string }
	} `yaml:"securityContext"`
	VolumeMounts []struct {
		Name      string
		MountPath string `yaml:"mountPath"`
		ReadOnly  bool   `yaml:"readOnly"`
	} `yaml:"volumeMounts"`
}

func decodeObject(t *testing.T, d map[string]any) k8sObject {
	t.Helper()
	b, err := yaml.Marshal(d)
	must(t, err)
	var o k8sObject
	must(t, yaml.Unmarshal(b, &o))
	if o.Kind == "Service" {
		// A Service's selector is a plain map, not matchLabels.
		if sel, ok := d["spec"].(map[string]any)["selector"].(map[string]any); ok {
			o.Spec.SelectorMap = map[string]string{}
			for k, v := range sel {
				o.Spec.SelectorMap[k], _ = v.(string)
			}
		}
	}
	return o
}

// runFlagEnv is every JETBOX_* variable of `jetbox run`'s flags.
func runFlagEnv() map[string]bool {
	out := map[string]bool{}
	rt := reflect.TypeOf(RunFlags{})
	for i := 0; i < rt.NumField(); i++ {
		if env := rt.Field(i).Tag.Get("env"); env != "" {
			out[env] = true
		}
	}
	return out
}

func subset(small, big map[string]string) bool {
	if len(small) == 0 {
		return false
	}
	for k, v := range small {
		if big[k] != v {
			return false
		}
	}
	return true
}

// chartVariant is one documented set of values and what it must render.
type chartVariant struct {
	file     string // ci/<file>, "" for the defaults
	kind     string // the workload
	replicas int
	ready    string // the readiness path
}

var chartVariants = []chartVariant{
	{"", "Deployment", 2, "/healthz"},
	{"single-values.yaml", "Deployment", 1, "/readyz"},
	{"password-values.yaml", "Deployment", 3, "/healthz"},
	{"nats-auth-values.yaml", "Deployment", 2, "/healthz"},
	{"monitoring-values.yaml", "Deployment", 2, "/healthz"},
	{"nkey-values.yaml", "Deployment", 2, "/healthz"},
	{"token-values.yaml", "Deployment", 2, "/healthz"},
	{"sidecar-values.yaml", "StatefulSet", 1, "/healthz"},
}

// TestHelmChart renders deploy/helm/jetbox with the default values and each
// variant in its ci/ directory, and checks the manifests against jetbox's
// configuration names, port and probes, as TestDeployFiles does for the
// plain manifests.
func TestHelmChart(t *testing.T) {
	if testing.Short() {
		t.Skip("runs helm (-short)")
	}
	helm := helmBin(t)
	files, err := filepath.Glob(filepath.Join(chartDir, "ci", "*-values.yaml"))
	must(t, err)
	ops, err := os.ReadFile(filepath.Join(repoRoot, "docs/operations.md"))
	must(t, err)
	var listed []string
	for _, v := range chartVariants {
		listed = append(listed, v.file)
	}
	for _, f := range files {
		if !slices.Contains(listed, filepath.Base(f)) {
			t.Errorf("ci/%s is not checked by TestHelmChart", filepath.Base(f))
		}
		if !strings.Contains(string(ops), "ci/"+filepath.Base(f)) {
			t.Errorf("docs/operations.md does not document ci/%s", filepath.Base(f))
		}
	}
	checkRuleFiles(t, helm)
	checkRuleValues(t, helm)
	alerts, err := os.ReadFile(filepath.Join(repoRoot, "deploy/prometheus/alerts.yaml"))
	must(t, err)
	known := exportedSeries(t)
	flagEnv := runFlagEnv()
	for _, v := range chartVariants {
		name := v.file
		if name == "" {
			name = "defaults"
		}
		t.Run(name, func(t *testing.T) {
			var args []string
			if v.file != "" {
				args = []string{"-f", filepath.Join(chartDir, "ci", v.file)}
			}
			lint := exec.Command(helm, append([]string{"lint", "--strict", "--kube-version", "1.30.0", chartDir}, args...)...)
			if out, err := lint.CombinedOutput(); err != nil {
				t.Errorf("helm lint --strict: %v\n%s", err, out)
			}
			docs, err := helmTemplate(t, helm, args...)
			if err != nil {
				t.Fatal(err)
			}
			checkChart(t, v, docs, flagEnv, known, alerts)
		})
	}
	// The chart refuses what must not be plain configuration.
	for _, set := range []string{"config.postgres-url=postgres://x", "config.http-addr=:9090", "config.nats-password=x", "mode=cluster", "postgres.urlSecret.name=", "config.MaxInFlight=1"} {
		if _, err := helmTemplate(t, helm, "--set", set); err == nil {
			t.Errorf("helm template --set %s: rendered, want a refusal", set)
		}
	}
}

func checkChart(t *testing.T, v chartVariant, docs []map[string]any, flagEnv map[string]bool, known series, alerts []byte) {
	objs := map[string]k8sObject{}
	for _, d := range docs {
		o := decodeObject(t, d)
		if _, dup := objs[o.Kind]; dup {
			t.Errorf("two %s objects", o.Kind)
		}
		objs[o.Kind] = o
	}
	w, ok := objs[v.kind]
	if !ok {
		t.Fatalf("no %s (rendered %v)", v.kind, slices.Collect(func(yield func(string) bool) {
			for k := range objs {
				if !yield(k) {
					return
				}
			}
		}))
	}
	for _, other := range []string{"Deployment", "StatefulSet"} {
		if _, ok := objs[other]; ok && other != v.kind {
			t.Errorf("renders a %s besides the %s", other, v.kind)
		}
	}
	if w.Spec.Replicas == nil || *w.Spec.Replicas != v.replicas {
		t.Errorf("%s replicas %v, want %d", v.kind, w.Spec.Replicas, v.replicas)
	}
	podLabels := w.Spec.Template.Metadata.Labels
	if !subset(w.Spec.Selector.MatchLabels, podLabels) {
		t.Errorf("%s selector %v does not select its pods %v", v.kind, w.Spec.Selector.MatchLabels, podLabels)
	}
	if v.kind == "Deployment" && v.replicas > 1 {
		if ru := w.Spec.Strategy.RollingUpdate; w.Spec.Strategy.Type != "RollingUpdate" || ru["maxUnavailable"] != 1 || ru["maxSurge"] != 0 {
			t.Errorf("strategy %+v, want a rolling update one instance at a time", w.Spec.Strategy)
		}
	}
	pod := w.Spec.Template.Spec
	var jb *container
	for i, c := range pod.Containers {
		if c.Name == "jetbox" {
			jb = &pod.Containers[i]
		}
	}
	if jb == nil {
		t.Fatal("no jetbox container")
	}
	if !slices.Equal(jb.Args, []string{"run"}) {
		t.Errorf("args %v, want [run]", jb.Args)
	}
	env := map[string]string{}
	for _, e := range jb.Env {
		if strings.HasPrefix(e.Name, "JETBOX_") && !flagEnv[e.Name] {
			t.Errorf("sets %s, which is no flag of jetbox run", e.Name)
		}
		if _, dup := env[e.Name]; dup {
			t.Errorf("sets %s twice", e.Name)
		}
		switch {
		case e.Value != nil:
			env[e.Name] = *e.Value
		case e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil && e.ValueFrom.SecretKeyRef.Name != "" && e.ValueFrom.SecretKeyRef.Key != "":
			env[e.Name] = "secret:" + e.ValueFrom.SecretKeyRef.Name + "/" + e.ValueFrom.SecretKeyRef.Key
		default:
			t.Errorf("%s: neither a value nor a Secret reference", e.Name)
		}
	}
	// Secrets only ever come from Secrets.
	for _, name := range []string{"JETBOX_POSTGRES_URL", "JETBOX_NATS_PASSWORD", "JETBOX_NATS_TOKEN"} {
		if val, ok := env[name]; ok && !strings.HasPrefix(val, "secret:") {
			t.Errorf("%s is a plain value, want a secretKeyRef", name)
		}
	}
	if !strings.HasPrefix(env["JETBOX_POSTGRES_URL"], "secret:") {
		t.Errorf("JETBOX_POSTGRES_URL %q, want a secretKeyRef", env["JETBOX_POSTGRES_URL"])
	}
	if d := env["JETBOX_DELIVERY"]; d != DefaultDelivery {
		t.Errorf("JETBOX_DELIVERY %q, want the default %q, spelled out", d, DefaultDelivery)
	}
	// The configuration the chart renders is one jetbox accepts.
	flags := RunFlags{}
	rv := reflect.ValueOf(&flags).Elem()
	for i := 0; i < rv.NumField(); i++ {
		f := rv.Type().Field(i)
		val, set := env[f.Tag.Get("env")]
		if !set {
			val = f.Tag.Get("default")
			if name, ok := strings.CutPrefix(val, "${"); ok {
				val = flagVars[strings.TrimSuffix(name, "}")] // a default from a package constant
			}
		}
		if strings.HasPrefix(val, "secret:") {
			val = "postgres://u:p@db:5432/app" // stands for the Secret's value
			if f.Name != "PostgresURL" {
				val = "x"
			}
		}
		rv.Field(i).SetString(val)
	}
	standIn := filepath.Join(t.TempDir(), "file")
	must(t, os.WriteFile(standIn, []byte("x"), 0o600))
	for _, p := range []string{"JETBOX_NATS_CREDS", "JETBOX_NATS_NKEY", "JETBOX_NATS_TLS_CA", "JETBOX_NATS_TLS_CERT", "JETBOX_NATS_TLS_KEY"} {
		// Files: mounted from a Secret volume that holds them.
		path, ok := env[p]
		if !ok {
			continue
		}
		found := false
		for _, m := range jb.VolumeMounts {
			if !strings.HasPrefix(path, m.MountPath+"/") {
				continue
			}
			for _, vol := range pod.Volumes {
				if vol.Name != m.Name || vol.Secret == nil || vol.Secret.SecretName == "" {
					continue
				}
				file := strings.TrimPrefix(path, m.MountPath+"/")
				if len(vol.Secret.Items) == 0 {
					found = m.ReadOnly // the whole Secret
				}
				for _, it := range vol.Secret.Items {
					if it.Path == file {
						found = m.ReadOnly
					}
				}
			}
		}
		if !found {
			t.Errorf("%s=%s is no file of a read-only mounted Secret", p, path)
		}
		// Config checks that the files exist: stand in a real one.
		rv.FieldByName(map[string]string{"JETBOX_NATS_CREDS": "NatsCreds", "JETBOX_NATS_NKEY": "NatsNKey",
			"JETBOX_NATS_TLS_CA": "NatsTLSCA", "JETBOX_NATS_TLS_CERT": "NatsTLSCert", "JETBOX_NATS_TLS_KEY": "NatsTLSKey"}[p]).SetString(standIn)
	}
	if _, err := flags.Config(); err != nil {
		t.Errorf("jetbox refuses the rendered configuration: %v", err)
	}
	// Port, probes, resources, security.
	_, port, err := net.SplitHostPort(env["JETBOX_HTTP_ADDR"])
	if err != nil || len(jb.Ports) == 0 || jb.Ports[0].Name != "http" || strconv.Itoa(jb.Ports[0].ContainerPort) != port {
		t.Errorf("JETBOX_HTTP_ADDR %q vs container ports %+v", env["JETBOX_HTTP_ADDR"], jb.Ports)
	}
	if host, _, _ := net.SplitHostPort(env["JETBOX_HTTP_ADDR"]); host != "0.0.0.0" {
		t.Errorf("JETBOX_HTTP_ADDR %q: the probes and Prometheus reach the pod's IP, listen on 0.0.0.0", env["JETBOX_HTTP_ADDR"])
	}
	if jb.LivenessProbe.HTTPGet.Path != "/healthz" || jb.LivenessProbe.HTTPGet.Port != "http" {
		t.Errorf("liveness probe %+v, want /healthz on http", jb.LivenessProbe)
	}
	if jb.ReadinessProbe.HTTPGet.Path != v.ready || jb.ReadinessProbe.HTTPGet.Port != "http" {
		t.Errorf("readiness probe %+v, want %s on http", jb.ReadinessProbe, v.ready)
	}
	if jb.Resources.Requests["memory"] == "" || jb.Resources.Limits["memory"] == "" || jb.Resources.Requests["cpu"] == "" {
		t.Errorf("resources %+v: want cpu and memory requests and a memory limit", jb.Resources)
	}
	sc := jb.SecurityContext
	if sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser == 0 || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || !slices.Contains(sc.Capabilities.Drop, "ALL") {
		t.Errorf("jetbox securityContext %+v: want non-root, a read-only root filesystem, no privilege escalation, no capabilities", sc)
	}
	for _, m := range jb.VolumeMounts {
		found := false
		for _, vol := range pod.Volumes {
			found = found || vol.Name == m.Name
		}
		if !found {
			t.Errorf("mounts volume %q, which the pod does not have", m.Name)
		}
	}
	if v.kind == "StatefulSet" {
		var pg *container
		for i, c := range pod.Containers {
			if c.Name == "postgres" {
				pg = &pod.Containers[i]
			}
		}
		if pg == nil || !strings.Contains(strings.Join(pg.Args, " "), "wal_level=logical") {
			t.Error("sidecar: no postgres container with wal_level=logical")
		}
		if w.Spec.ServiceName != objs["Service"].Metadata.Name {
			t.Errorf("StatefulSet serviceName %q, Service %q", w.Spec.ServiceName, objs["Service"].Metadata.Name)
		}
	}
	// The Service publishes the http port of every instance, standbys too.
	svc, ok := objs["Service"]
	if !ok {
		t.Fatal("no Service")
	}
	if !subset(svc.Spec.SelectorMap, podLabels) || !svc.Spec.PublishNotReadyAddresses {
		t.Errorf("Service selector %v (pods %v), publishNotReadyAddresses %v", svc.Spec.SelectorMap, podLabels, svc.Spec.PublishNotReadyAddresses)
	}
	httpPort := false
	for _, p := range svc.Spec.Ports {
		httpPort = httpPort || (p.Name == "http" && p.TargetPort == "http" && strconv.Itoa(p.Port) == port)
	}
	if !httpPort {
		t.Errorf("Service ports %+v: no http port %s", svc.Spec.Ports, port)
	}
	pdb, ok := objs["PodDisruptionBudget"]
	if !ok || !subset(pdb.Spec.Selector.MatchLabels, podLabels) || pdb.Spec.MaxUnavailable != 1 || pdb.Spec.MinAvailable != nil {
		t.Errorf("PodDisruptionBudget %+v: want maxUnavailable 1 over the pods", pdb.Spec)
	}
	// Prometheus Operator objects, when enabled.
	_, hasSM := objs["ServiceMonitor"]
	_, hasRule := objs["PrometheusRule"]
	if monitoring := v.file == "monitoring-values.yaml"; hasSM != monitoring || hasRule != monitoring {
		t.Errorf("ServiceMonitor %v, PrometheusRule %v; want both only with monitoring-values.yaml", hasSM, hasRule)
	}
	if sm, ok := objs["ServiceMonitor"]; ok {
		if !subset(sm.Spec.Selector.MatchLabels, svc.Metadata.Labels) || len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != "http" || sm.Spec.Endpoints[0].Path != "/metrics" {
			t.Errorf("ServiceMonitor %+v does not scrape the Service's http port", sm.Spec)
		}
	}
	if rule, ok := objs["PrometheusRule"]; ok {
		b, err := yaml.Marshal(map[string]any{"groups": rule.Spec.Groups})
		must(t, err)
		parseRules(t, "PrometheusRule", b, known)
		want := strings.ReplaceAll(string(alerts), `job="jetbox"`, `job="`+svc.Metadata.Name+`"`)
		var wantRules, gotRules any
		must(t, yaml.Unmarshal([]byte(want), &wantRules))
		must(t, yaml.Unmarshal(b, &gotRules))
		if !reflect.DeepEqual(wantRules, gotRules) {
			t.Errorf("PrometheusRule is not deploy/prometheus/alerts.yaml for job=%q", svc.Metadata.Name)
		}
		if !strings.Contains(string(b), `job="`+svc.Metadata.Name+`"`) {
			t.Errorf("PrometheusRule does not select the ServiceMonitor's job %q", svc.Metadata.Name)
		}
	}
}
