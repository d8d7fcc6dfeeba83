// Command render renders a Helm chart the way `helm template` does, for
// testing the chart where no Helm binary is packaged: Go's text/template with
// the Sprig functions (Debian's golang-github-masterminds-sprig-dev, the
// library Helm uses), Helm's include, tpl, required, toYaml, fromYaml and
// lookup, and the built-in objects .Values, .Release, .Chart, .Capabilities
// and .Template. Values are read like Helm reads them (numbers become
// float64), merged from values.yaml and each -f file in order.
//
//	render -chart deploy/helm/colibri [-f more.yaml]... [-name colibri] [-namespace default] [-notes]
//
// Prints the rendered manifests ("---" and "# Source:" per document), or
// NOTES.txt with -notes. Exits 1 with the template error (e.g. a required
// value) if any template fails.
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig/v3"
	yaml2 "gopkg.in/yaml.v2"
	yaml3 "gopkg.in/yaml.v3"
)

type fileList []string

func (f *fileList) String() string     { return strings.Join(*f, ",") }
func (f *fileList) Set(v string) error { *f = append(*f, v); return nil }

// readYAML reads a YAML mapping the way Helm does: through JSON, so numbers
// are float64 and maps are map[string]interface{}.
func readYAML(path string) (map[string]interface{}, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var raw interface{}
	if err := yaml3.Unmarshal(data, &raw); err != nil {
		return nil, fmt.Errorf("%s: %v", path, err)
	}
	j, err := json.Marshal(raw)
	if err != nil {
		return nil, fmt.Errorf("%s: %v", path, err)
	}
	out := map[string]interface{}{}
	if string(j) != "null" {
		if err := json.Unmarshal(j, &out); err != nil {
			return nil, fmt.Errorf("%s: not a mapping: %v", path, err)
		}
	}
	return out, nil
}

// merge copies src into dst; nested maps merge, everything else replaces.
func merge(dst, src map[string]interface{}) {
	for k, v := range src {
		if sm, ok := v.(map[string]interface{}); ok {
			if dm, ok := dst[k].(map[string]interface{}); ok {
				merge(dm, sm)
				continue
			}
		}
		dst[k] = v
	}
}

func toYAML(v interface{}) string {
	out, err := yaml2.Marshal(v)
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(string(out), "\n")
}

func main() {
	chartDir := flag.String("chart", "", "chart directory (Chart.yaml, values.yaml, templates/)")
	name := flag.String("name", "colibri", "release name")
	namespace := flag.String("namespace", "default", "release namespace")
	notes := flag.Bool("notes", false, "print the rendered NOTES.txt instead of the manifests")
	var files fileList
	flag.Var(&files, "f", "values file merged over values.yaml (repeatable)")
	flag.Parse()
	if *chartDir == "" {
		fmt.Fprintln(os.Stderr, "render: -chart is required")
		os.Exit(2)
	}
	if err := run(*chartDir, *name, *namespace, files, *notes); err != nil {
		fmt.Fprintln(os.Stderr, "render:", err)
		os.Exit(1)
	}
}

func run(chartDir, name, namespace string, files []string, notes bool) error {
	meta, err := readYAML(filepath.Join(chartDir, "Chart.yaml"))
	if err != nil {
		return err
	}
	values, err := readYAML(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		return err
	}
	for _, f := range files {
		more, err := readYAML(f)
		if err != nil {
			return err
		}
		merge(values, more)
	}
	chartName, _ := meta["name"].(string)
	top := map[string]interface{}{
		"Values":  values,
		"Release": map[string]interface{}{"Name": name, "Namespace": namespace, "Service": "Helm", "IsInstall": true, "IsUpgrade": false, "Revision": 1},
		"Chart": map[string]interface{}{"Name": chartName, "Version": meta["version"], "AppVersion": meta["appVersion"],
			"Description": meta["description"], "Type": meta["type"], "APIVersion": meta["apiVersion"]},
		"Capabilities": map[string]interface{}{
			"KubeVersion": map[string]interface{}{"Version": "v1.28.0", "Major": "1", "Minor": "28", "GitVersion": "v1.28.0"},
			"APIVersions": []string{"v1", "apps/v1", "policy/v1"},
		},
	}

	t := template.New("gotpl").Option("missingkey=zero")
	funcs := sprig.TxtFuncMap()
	funcs["include"] = func(tname string, data interface{}) (string, error) {
		var b bytes.Buffer
		err := t.ExecuteTemplate(&b, tname, data)
		return b.String(), err
	}
	funcs["tpl"] = func(text string, data interface{}) (string, error) {
		c, err := t.Clone()
		if err != nil {
			return "", err
		}
		p, err := c.New("tpl").Parse(text)
		if err != nil {
			return "", err
		}
		var b bytes.Buffer
		err = p.Execute(&b, data)
		return b.String(), err
	}
	funcs["required"] = func(msg string, v interface{}) (interface{}, error) {
		if v == nil {
			return nil, fmt.Errorf("%s", msg)
		}
		if s, ok := v.(string); ok && s == "" {
			return nil, fmt.Errorf("%s", msg)
		}
		return v, nil
	}
	funcs["toYaml"] = toYAML
	funcs["fromYaml"] = func(s string) map[string]interface{} {
		m := map[string]interface{}{}
		_ = yaml3.Unmarshal([]byte(s), &m)
		return m
	}
	funcs["lookup"] = func(...interface{}) map[string]interface{} { return map[string]interface{}{} }
	t.Funcs(funcs)

	paths, err := filepath.Glob(filepath.Join(chartDir, "templates", "*"))
	if err != nil {
		return err
	}
	sort.Strings(paths)
	for _, p := range paths {
		text, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		tname := chartName + "/templates/" + filepath.Base(p)
		if _, err := t.New(tname).Parse(string(text)); err != nil {
			return err
		}
	}
	var out bytes.Buffer
	for _, p := range paths {
		base := filepath.Base(p)
		isNotes := base == "NOTES.txt"
		if strings.HasPrefix(base, "_") || isNotes != notes {
			continue
		}
		tname := chartName + "/templates/" + base
		data := map[string]interface{}{}
		for k, v := range top {
			data[k] = v
		}
		data["Template"] = map[string]interface{}{"Name": tname, "BasePath": chartName + "/templates"}
		var b bytes.Buffer
		if err := t.ExecuteTemplate(&b, tname, data); err != nil {
			return err
		}
		rendered := strings.ReplaceAll(b.String(), "<no value>", "")
		if notes {
			out.WriteString(rendered)
			continue
		}
		if strings.TrimSpace(rendered) == "" {
			continue
		}
		fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", tname, strings.TrimSpace(rendered))
	}
	_, err = os.Stdout.Write(out.Bytes())
	return err
}
