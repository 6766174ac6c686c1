// yamlcheck reads a multi-document YAML stream on stdin the way kubectl does (documents split
// at `---` lines, each converted by sigs.k8s.io/yaml.YAMLToJSON: YAML 1.1 resolution, where
// `yes`, `on` and `y` are booleans and `1_000` is a number) and prints the documents as one
// JSON array on stdout. Empty documents are left out. Exit 1 with a message on stderr when a
// document is not YAML.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"

	"sigs.k8s.io/yaml"
)

func main() {
	in, err := io.ReadAll(bufio.NewReader(os.Stdin))
	if err != nil {
		fmt.Fprintln(os.Stderr, "yamlcheck: reading stdin:", err)
		os.Exit(1)
	}
	var docs [][]byte
	var cur bytes.Buffer
	for _, line := range strings.SplitAfter(string(in), "\n") {
		if strings.TrimRight(line, "\r\n") == "---" {
			docs = append(docs, append([]byte(nil), cur.Bytes()...))
			cur.Reset()
			continue
		}
		cur.WriteString(line)
	}
	docs = append(docs, cur.Bytes())
	out := []json.RawMessage{}
	for i, d := range docs {
		j, err := yaml.YAMLToJSON(d)
		if err != nil {
			fmt.Fprintf(os.Stderr, "yamlcheck: document %d: %v\n", i, err)
			os.Exit(1)
		}
		if string(j) == "null" {
			continue
		}
		out = append(out, j)
	}
	enc, err := json.Marshal(out)
	if err != nil {
		fmt.Fprintln(os.Stderr, "yamlcheck:", err)
		os.Exit(1)
	}
	os.Stdout.Write(enc)
	os.Stdout.Write([]byte("\n"))
}
