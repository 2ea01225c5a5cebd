#!powershell

# The Windows twin of plugins/modules/llama_api_check.py (its DOCUMENTATION documents both): the same options, the same
# checks, the same failures and the same result fields, so the llama_verify role and the controller's verdict
# read one contract on both OSes. tests/unit/plugins/test_llama_api_check_contract.py compares the lists.
#
# RETURN (as llama_api_check.py's RETURN):
#   health: str
#   served_ids: list
#   loaded_ids: list
#   openai: dict (seconds, object, completion_tokens, tokens_per_second, text)
#   anthropic: dict (type, output_tokens, stop_reason, text)
#   auth: dict (required, anonymous_status, wrong_key_status)
#   tool_call: dict (ok, tool_use, tool_name, stop_reason, final_stop_reason, detail)
#   streams: dict (openai, anthropic)
#   throughput: dict (prompt_tokens, prompt_per_second, predicted_tokens, predicted_per_second, detail)

#AnsibleRequires -CSharpUtil Ansible.Basic

$spec = @{
    options = @{
        base_url = @{ type = 'str'; required = $true }
        model = @{ type = 'str'; required = $true }
        api_key = @{ type = 'str'; default = ''; no_log = $true }
        api_key_file = @{ type = 'str'; default = '' }
        api_key_file_optional = @{ type = 'bool'; default = $false }
        prompt = @{ type = 'str'; default = 'Say hello in five words.' }
        max_tokens = @{ type = 'int'; default = 16 }
        timeout = @{ type = 'int'; default = 120 }
        chat = @{ type = 'bool'; default = $true }
        certify = @{ type = 'bool'; default = $false }
        throughput_max_tokens = @{ type = 'int'; default = 64 }
        throughput_runs = @{ type = 'int'; default = 3 }
    }
    supports_check_mode = $true
}
$module = [Ansible.Basic.AnsibleModule]::Create($args, $spec)

$textKept = 200
$baseUrl = $module.Params.base_url.TrimEnd('/')
if ($module.Params.certify -and -not $module.Params.chat) {
    $module.Result.health = 'unknown'
    $module.FailJson('certify needs chat: true (the certification''s checks are chat turns)')
}
foreach ($name in @('throughput_max_tokens', 'throughput_runs')) {
    if ($module.Params[$name] -lt 1) {
        $module.Result.health = 'unknown'
        $module.FailJson("$name must be at least 1, not $($module.Params[$name])")
    }
}
$model = $module.Params.model
$apiKey = $module.Params.api_key
if (-not $apiKey -and $module.Params.api_key_file -and -not ($module.Params.api_key_file_optional -and
        -not [System.IO.File]::Exists($module.Params.api_key_file))) {
    # The server's own key file, read on the host, so the key never leaves it (an optional one that is not there:
    # the server has no key).
    try {
        $apiKey = ([System.IO.File]::ReadAllLines($module.Params.api_key_file) | Select-Object -First 1).Trim()
    }
    catch {
        $module.Result.health = 'unknown'
        $module.FailJson("cannot read the key file $($module.Params.api_key_file): $($_.Exception.Message)")
    }
}
$timeoutMs = $module.Params.timeout * 1000

function Open-Response {
    # Sends one request; returns @{ response = <the response or $null>; error = <string or $null> }. An HTTP error
    # status keeps its response, so its status and body can be read.
    param (
        [Parameter(Mandatory)][string]$Path,
        [hashtable]$Headers = @{},
        [object]$Body = $null
    )
    $request = [System.Net.HttpWebRequest]::Create($baseUrl + $Path)
    $request.Timeout = $timeoutMs
    $request.ReadWriteTimeout = $timeoutMs
    $request.Proxy = $null
    $request.Method = 'GET'
    foreach ($name in $Headers.Keys) {
        $request.Headers.Add($name, $Headers[$name])
    }
    if ($null -ne $Body) {
        $request.Method = 'POST'
        $request.ContentType = 'application/json'
        $bytes = [System.Text.Encoding]::UTF8.GetBytes(($Body | ConvertTo-Json -Depth 16 -Compress))
        $request.ContentLength = $bytes.Length
    }
    try {
        if ($null -ne $Body) {
            $stream = $request.GetRequestStream()
            $stream.Write($bytes, 0, $bytes.Length)
            $stream.Close()
        }
        return @{ response = $request.GetResponse(); error = $null }
    }
    catch [System.Net.WebException] {
        if ($null -eq $_.Exception.Response) {
            return @{ response = $null; error = $_.Exception.Message }
        }
        return @{ response = $_.Exception.Response; error = $null }
    }
    catch {
        return @{ response = $null; error = $_.Exception.Message }
    }
}

function Send-Request {
    # One request; returns @{ status = <int or $null>; body = <string>; error = <string or $null> }.
    param (
        [Parameter(Mandatory)][string]$Path,
        [hashtable]$Headers = @{},
        [object]$Body = $null
    )
    $opened = Open-Response -Path $Path -Headers $Headers -Body $Body
    if ($null -ne $opened.error) {
        return @{ status = $null; body = ''; error = $opened.error }
    }
    $response = $opened.response
    try {
        $reader = New-Object System.IO.StreamReader($response.GetResponseStream(), [System.Text.Encoding]::UTF8)
        $text = $reader.ReadToEnd()
        $reader.Close()
        return @{ status = [int]$response.StatusCode; body = $text; error = $null }
    }
    catch {
        return @{ status = $null; body = ''; error = $_.Exception.Message }
    }
    finally {
        $response.Close()
    }
}

function Stop-Unreachable {
    # As the Linux module: a request that gets no usable answer fails the module with health "unreachable".
    param ([Parameter(Mandatory)][string]$Reason)
    foreach ($field in @('served_ids', 'loaded_ids', 'openai', 'anthropic', 'auth', 'tool_call', 'streams', 'throughput')) {
        $null = $module.Result.Remove($field)
    }
    $module.Result.health = 'unreachable'
    $module.FailJson("$($baseUrl): $Reason")
}

function Get-Answer {
    # A request that must answer 2xx with JSON (an empty body reads as an empty object, as in the Linux module):
    # @{ value = <decoded body or $null>; error = <reason or $null> }. The certification's checks report the reason.
    param (
        [Parameter(Mandatory)][string]$Path,
        [hashtable]$Headers = @{},
        [object]$Body = $null
    )
    $answer = Send-Request -Path $Path -Headers $Headers -Body $Body
    if ($null -ne $answer.error) {
        return @{ value = $null; error = "$Path`: $($answer.error)" }
    }
    if ($answer.status -lt 200 -or $answer.status -ge 300) {
        return @{ value = $null; error = "$Path answered HTTP $($answer.status)$(Get-ErrorText $answer.body)" }
    }
    if ([string]::IsNullOrWhiteSpace($answer.body)) {
        return @{ value = [PSCustomObject]@{}; error = $null }
    }
    try {
        return @{ value = ($answer.body | ConvertFrom-Json); error = $null }
    }
    catch {
        return @{ value = $null; error = "$Path did not answer JSON" }
    }
}

function Invoke-Json {
    # Get-Answer for the four checks: a request that gets no usable answer fails the module (Stop-Unreachable).
    param (
        [Parameter(Mandatory)][string]$Path,
        [hashtable]$Headers = @{},
        [object]$Body = $null
    )
    $answer = Get-Answer -Path $Path -Headers $Headers -Body $Body
    if ($null -ne $answer.error) {
        Stop-Unreachable $answer.error
    }
    return $answer.value
}

function Get-Field {
    param ([object]$Object, [string[]]$Names, [object]$Default)
    $value = $Object
    foreach ($name in $Names) {
        if ($null -eq $value -or -not ($value.PSObject.Properties.Name -contains $name)) {
            return $Default
        }
        $value = $value.$name
    }
    if ($null -eq $value) { return $Default }
    return $value
}

function Limit-Text {
    param ([string]$Text)
    if ($Text.Length -gt $textKept) { return $Text.Substring(0, $textKept) }
    return $Text
}

function Get-ErrorText {
    # The server's own error message from an error body, as ": message"; empty when it sent none.
    param ([string]$Text)
    try {
        $parsed = $Text | ConvertFrom-Json
    }
    catch {
        return ''
    }
    $errorField = Get-Field $parsed @('error') $null
    $message = Get-Field $errorField @('message') $errorField
    if ($null -eq $message -or $message -isnot [string]) {
        return ''
    }
    return ": $(Limit-Text $message)"
}

$headers = @{}
if ($apiKey) {
    $headers = @{ 'Authorization' = "Bearer $apiKey"; 'x-api-key' = $apiKey }
}
$problems = [System.Collections.Generic.List[string]]@()

$health = Invoke-Json -Path '/health'
$module.Result.health = [string](Get-Field $health @('status') 'unknown')
if ($module.Result.health -ne 'ok') {
    $problems.Add("/health says $($module.Result.health)")
}

$listed = Invoke-Json -Path '/v1/models' -Headers $headers
$module.Result.served_ids = @(@(Get-Field $listed @('data') @()) | ForEach-Object { [string](Get-Field $_ @('id') '') })
# a router lists each model with its status; an ordinary server's one model is always loaded
$module.Result.loaded_ids = @(@(Get-Field $listed @('data') @()) |
    Where-Object { [string](Get-Field $_ @('status', 'value') 'loaded') -eq 'loaded' } |
    ForEach-Object { [string](Get-Field $_ @('id') '') })
if ($module.Result.served_ids -notcontains $model) {
    $problems.Add("serves ['$($module.Result.served_ids -join "', '")'], not $model")
}

# chat: false (controller status) stops here: health and the model id through the key, no chat turns.
if (-not $module.Params.chat) {
    $module.Result.changed = $false
    if ($problems.Count -gt 0) {
        $module.FailJson("$($baseUrl): $($problems -join '; ')")
    }
    $module.ExitJson()
}

$messages = @(@{ role = 'user'; content = $module.Params.prompt })
$chat = @{ model = $model; messages = $messages; max_tokens = $module.Params.max_tokens }

$watch = [System.Diagnostics.Stopwatch]::StartNew()
$openai = Invoke-Json -Path '/v1/chat/completions' -Headers $headers -Body $chat
$watch.Stop()
$choice = @(Get-Field $openai @('choices') @()) | Select-Object -First 1
$module.Result.openai = @{
    seconds = [math]::Round($watch.Elapsed.TotalSeconds, 3)
    object = [string](Get-Field $openai @('object') '')
    completion_tokens = [int](Get-Field $openai @('usage', 'completion_tokens') 0)
    tokens_per_second = [math]::Round([double](Get-Field $openai @('timings', 'predicted_per_second') 0), 2)
    text = Limit-Text ([string](Get-Field $choice @('message', 'content') ''))
}
if ($module.Result.openai.object -ne 'chat.completion') {
    $problems.Add("the OpenAI API answered '$($module.Result.openai.object)', not a chat.completion")
}

$anthropicHeaders = $headers.Clone()
$anthropicHeaders['anthropic-version'] = '2023-06-01'
$anthropic = Invoke-Json -Path '/v1/messages' -Headers $anthropicHeaders -Body $chat
$parts = @(Get-Field $anthropic @('content') @()) | Where-Object { (Get-Field $_ @('type') '') -eq 'text' }
$module.Result.anthropic = @{
    type = [string](Get-Field $anthropic @('type') '')
    output_tokens = [int](Get-Field $anthropic @('usage', 'output_tokens') 0)
    stop_reason = [string](Get-Field $anthropic @('stop_reason') '')
    text = Limit-Text ((@($parts) | ForEach-Object { [string](Get-Field $_ @('text') '') }) -join '')
}
if ($module.Result.anthropic.type -ne 'message') {
    $problems.Add("the Anthropic API answered '$($module.Result.anthropic.type)', not a message")
}

# A server with a key must refuse a chat request without it and with a wrong one (ik_llama.cpp leaves
# /health and /v1/models open even with a key, so the chat endpoint is the one probed).
if ($apiKey) {
    $probe = @{ model = $model; messages = @(@{ role = 'user'; content = 'hi' }); max_tokens = 1 }
    $wrong = 'wrong-' + [guid]::NewGuid().ToString('N').Substring(0, 16)
    $anonymous = Send-Request -Path '/v1/chat/completions' -Body $probe
    $wrongKey = Send-Request -Path '/v1/chat/completions' -Body $probe -Headers @{
        'Authorization' = "Bearer $wrong"; 'x-api-key' = $wrong
    }
    foreach ($answer in @($anonymous, $wrongKey)) {
        if ($null -ne $answer.error) {
            Stop-Unreachable "/v1/chat/completions: $($answer.error)"
        }
    }
    $module.Result.auth = @{
        required = $true
        anonymous_status = $anonymous.status
        wrong_key_status = $wrongKey.status
    }
    foreach ($pair in @(@('anonymous_status', 'without a key'), @('wrong_key_status', 'with a wrong key'))) {
        if ($module.Result.auth[$pair[0]] -ne 401) {
            $problems.Add("/v1/chat/completions answered HTTP $($module.Result.auth[$pair[0]]) $($pair[1]), not 401: " +
                'the server does not check its API key')
        }
    }
}
else {
    $module.Result.auth = @{ required = $false }
}

# controller certify: a tool call round trip, a stream through each API and the throughput, as the Linux module
# (check_tool_call, check_openai_stream, check_anthropic_stream, check_throughput). What they find goes into the
# fields with a detail sentence; they never fail the module.
$anthropicVersion = '2023-06-01'
# An enum keeps the tool's one argument short even from a model that writes at random.
$certifyTool = @{
    name = 'get_time'
    description = 'The current time in a time zone.'
    input_schema = @{
        type = 'object'
        properties = @{ timezone = @{ type = 'string'; enum = @('UTC', 'Europe/Berlin') } }
        required = @('timezone')
    }
}
$certifyToolPrompt = 'What time is it in UTC? Use the get_time tool.'
$certifyToolResult = '12:00'
$certifyToolMaxTokens = 256
# Never change it: the catalog's throughput bands were measured with it (the Linux module's THROUGHPUT_PROMPT,
# which a test compares with this one).
$throughputPrompt = (
    'Summarise the following maintenance note in one sentence. The workshop keeps four machines for its model ' +
    'servers. Each machine has two graphics cards joined by a bridge, a processor with sixteen cores, and enough ' +
    'memory to hold the largest model twice. Every morning the night shift checks the fans, reads the temperature ' +
    'log, and restarts any service that stopped during the night. When a card runs hotter than eighty degrees, the ' +
    'service on it is paused until the card cools again, and the pause is written into the log with the time and ' +
    'the temperature. Once a week the team runs a fixed benchmark on every machine and compares the speed with the ' +
    'figure recorded when the machine was delivered; a machine that is much slower than its figure is taken out of ' +
    'service and inspected. The most common causes so far were a fan clogged with dust, a power cable that was not ' +
    'fully seated, a card that had been moved into a slower slot, and a driver update that changed the power mode. ' +
    'Each cause was fixed within a day, and the speed returned to its delivered figure.'
)

function Read-EventStream {
    # The data: payloads of a server-sent event stream, decoded where they are JSON ('[DONE]' stays a string), up to
    # '[DONE]' or a message_stop: @{ events = <list>; error = <reason or $null> } (the events before an error stay).
    param (
        [Parameter(Mandatory)][string]$Path,
        [hashtable]$Headers = @{},
        [Parameter(Mandatory)][object]$Body
    )
    $events = [System.Collections.Generic.List[object]]@()
    $opened = Open-Response -Path $Path -Headers $Headers -Body $Body
    if ($null -ne $opened.error) {
        return @{ events = $events; error = "$Path`: $($opened.error)" }
    }
    $response = $opened.response
    try {
        $reader = New-Object System.IO.StreamReader($response.GetResponseStream(), [System.Text.Encoding]::UTF8)
        $status = [int]$response.StatusCode
        if ($status -lt 200 -or $status -ge 300) {
            return @{ events = $events; error = "$Path answered HTTP $status$(Get-ErrorText $reader.ReadToEnd())" }
        }
        $deadline = [DateTime]::UtcNow.AddSeconds($module.Params.timeout)
        while ($null -ne ($line = $reader.ReadLine())) {
            if ([DateTime]::UtcNow -gt $deadline) {
                return @{ events = $events; error = "$Path was still streaming after $($module.Params.timeout) s" }
            }
            $line = $line.Trim()
            if (-not $line.StartsWith('data:')) {
                continue
            }
            $payload = $line.Substring(5).Trim()
            try {
                $events.Add(($payload | ConvertFrom-Json))
            }
            catch {
                $events.Add($payload)
            }
            if ($payload -eq '[DONE]' -or (Get-Field $events[$events.Count - 1] @('type') '') -eq 'message_stop') {
                break
            }
        }
        return @{ events = $events; error = $null }
    }
    catch {
        return @{ events = $events; error = "$Path stopped streaming: $($_.Exception.Message)" }
    }
    finally {
        $response.Close()
    }
}

function Test-ToolCall {
    # A tool definition in (tool_choice any: the server's grammar must produce a call), a tool_use block out, its
    # tool_result back, and a final message.
    $result = @{ ok = $false; tool_use = $false; tool_name = $null; stop_reason = $null; final_stop_reason = $null }
    $toolHeaders = $headers.Clone()
    $toolHeaders['anthropic-version'] = $anthropicVersion
    $asked = @(@{ role = 'user'; content = $certifyToolPrompt })
    $first = Get-Answer -Path '/v1/messages' -Headers $toolHeaders -Body @{
        model = $model; messages = $asked; max_tokens = $certifyToolMaxTokens; temperature = 0
        tools = @($certifyTool); tool_choice = @{ type = 'any' }
    }
    if ($null -ne $first.error) {
        $result.detail = "the request with a tool failed: $($first.error)"
        return $result
    }
    $result.stop_reason = Get-Field $first.value @('stop_reason') $null
    $content = @(@(Get-Field $first.value @('content') @()) | Where-Object { $null -ne $_ -and $_ -isnot [string] })
    $uses = @($content | Where-Object { (Get-Field $_ @('type') '') -eq 'tool_use' })
    $type = Get-Field $first.value @('type') $null
    if ($type -ne 'message' -or $uses.Count -eq 0) {
        $result.detail = "the reply to a request with a tool (tool_choice any) had no tool_use block (type '$type', " +
            "stop_reason '$($result.stop_reason)'): the model's chat template may not support tool calls"
        return $result
    }
    $use = $uses[0]
    $result.tool_use = $true
    $result.tool_name = Get-Field $use @('name') $null
    if ($result.tool_name -ne $certifyTool.name) {
        $result.detail = "the model called '$($result.tool_name)', a tool it was not given"
        return $result
    }
    # The tools are not sent again: the reply to a tool_result is then read as plain content, which every chat
    # template allows (with tools, a template whose calls have no start marker cannot carry a plain answer).
    $answered = @(
        $asked[0],
        @{ role = 'assistant'; content = $content },
        @{ role = 'user'; content = @(@{
            type = 'tool_result'; tool_use_id = (Get-Field $use @('id') ''); content = $certifyToolResult }) }
    )
    $final = Get-Answer -Path '/v1/messages' -Headers $toolHeaders -Body @{
        model = $model; messages = $answered; max_tokens = $module.Params.max_tokens; temperature = 0
    }
    if ($null -ne $final.error) {
        $result.detail = "$($result.tool_name) was called (stop_reason '$($result.stop_reason)'), but the request " +
            "with its tool_result failed: $($final.error)"
        return $result
    }
    $result.final_stop_reason = Get-Field $final.value @('stop_reason') $null
    $finalType = Get-Field $final.value @('type') $null
    if ($finalType -ne 'message') {
        $result.detail = "the reply to the tool_result was '$finalType', not a message"
        return $result
    }
    $result.ok = $true
    $result.detail = "$($result.tool_name) was called (stop_reason '$($result.stop_reason)'); its tool_result came " +
        "back and the model answered (stop_reason '$($result.final_stop_reason)')"
    return $result
}

function Complete-StreamCheck {
    # The verdict of a stream check on what it read: $Count chunks or events ($Unit) came, $Ended says whether the
    # stream's end mark ($EndMark) came; a stream that ended without anything before its mark fails with
    # $NothingBefore when one is given. Sets ok and detail of $Result and returns it.
    param (
        [Parameter(Mandatory)][hashtable]$Result,
        [Parameter(Mandatory)][hashtable]$Read,
        [int]$Count,
        [string]$Unit,
        [bool]$Ended,
        [string]$EndMark,
        [string]$Passed,
        [string]$NothingBefore = ''
    )
    if ($null -ne $Read.error -and -not $Ended) {
        $Result.detail = "after $Count $($Unit): $($Read.error)"
    }
    elseif (-not $Ended) {
        $Result.detail = "the stream ended after $Count $Unit without $EndMark"
    }
    elseif ($NothingBefore -and $Count -eq 0) {
        $Result.detail = $NothingBefore
    }
    else {
        $Result.ok = $true
        $Result.detail = $Passed
    }
    return $Result
}

function Test-OpenAIStream {
    $result = @{ ok = $false; chunks = 0; done = $false; detail = '' }
    $read = Read-EventStream -Path '/v1/chat/completions' -Headers $headers -Body @{
        model = $model; messages = @(@{ role = 'user'; content = 'Count to five.' })
        max_tokens = $module.Params.max_tokens; stream = $true
    }
    foreach ($sent in $read.events) {
        if ($sent -is [string] -and $sent -eq '[DONE]') {
            $result.done = $true
            break
        }
        $errorField = Get-Field $sent @('error') $null
        if ($null -ne $errorField) {
            $result.detail = "the stream carried an error after $($result.chunks) chunks: " +
                "$(Get-Field $errorField @('message') $errorField)"
            return $result
        }
        $result.chunks += 1
    }
    return Complete-StreamCheck -Result $result -Read $read -Count $result.chunks -Unit 'chunks' -Ended $result.done `
        -EndMark 'data: [DONE]' -Passed "$($result.chunks) chunks, then data: [DONE]" `
        -NothingBefore 'the stream sent data: [DONE] without a chunk before it'
}

function Test-AnthropicStream {
    $result = @{ ok = $false; events = 0; message_stop = $false; detail = '' }
    $streamHeaders = $headers.Clone()
    $streamHeaders['anthropic-version'] = $anthropicVersion
    $read = Read-EventStream -Path '/v1/messages' -Headers $streamHeaders -Body @{
        model = $model; messages = @(@{ role = 'user'; content = 'Count to five.' })
        max_tokens = $module.Params.max_tokens; stream = $true
    }
    foreach ($sent in $read.events) {
        $result.events += 1
        $kind = Get-Field $sent @('type') $null
        $errorField = Get-Field $sent @('error') $null
        if ($kind -eq 'error' -or ($null -ne (Get-Field $sent @('code') $null) -and
                $null -ne (Get-Field $sent @('message') $null))) {
            $message = Get-Field $errorField @('message') (Get-Field $sent @('message') '')
            $result.detail = "the stream carried an error after $($result.events - 1) events: $message"
            return $result
        }
        if ($kind -eq 'message_stop') {
            $result.message_stop = $true
            break
        }
    }
    return Complete-StreamCheck -Result $result -Read $read -Count $result.events -Unit 'events' `
        -Ended $result.message_stop -EndMark 'message_stop' -Passed "$($result.events) events, the last message_stop"
}

function Get-Median {
    param ([double[]]$Values)
    $sorted = @($Values | Sort-Object)
    $middle = [int][math]::Floor($sorted.Count / 2)
    if ($sorted.Count % 2 -eq 1) {
        return $sorted[$middle]
    }
    return ($sorted[$middle - 1] + $sorted[$middle]) / 2
}

function Test-Throughput {
    # The server's own timings for the fixed prompt, the median of throughput_runs requests (one slow request on a
    # busy machine does not decide): each processes the prompt afresh (no cache) at temperature 0 and generates
    # throughput_max_tokens without stopping early where the server supports ignore_eos.
    $wanted = $module.Params.throughput_max_tokens
    $runs = $module.Params.throughput_runs
    $result = @{ prompt_tokens = $null; prompt_per_second = $null; predicted_tokens = $null; predicted_per_second = $null }
    $measured = [System.Collections.Generic.List[object]]@()
    foreach ($run in 1..$runs) {
        $answer = Get-Answer -Path '/v1/chat/completions' -Headers $headers -Body @{
            model = $model; messages = @(@{ role = 'user'; content = $throughputPrompt }); max_tokens = $wanted
            temperature = 0; ignore_eos = $true; cache_prompt = $false
        }
        if ($null -ne $answer.error) {
            $result.detail = "throughput request $run of $runs failed: $($answer.error)"
            return $result
        }
        $timings = Get-Field $answer.value @('timings') $null
        if ($null -eq (Get-Field $timings @('predicted_per_second') $null)) {
            $result.detail = "the server's reply has no timings (llama-server reports them with each reply)"
            return $result
        }
        $measured.Add($timings)
    }
    $result.prompt_tokens = [int][math]::Floor((Get-Median @($measured | ForEach-Object {
        [double](Get-Field $_ @('prompt_n') 0) })))
    $result.prompt_per_second = [math]::Round((Get-Median @($measured | ForEach-Object {
        [double](Get-Field $_ @('prompt_per_second') 0) })), 2)
    $result.predicted_tokens = [int][math]::Floor((Get-Median @($measured | ForEach-Object {
        [double](Get-Field $_ @('predicted_n') 0) })))
    $result.predicted_per_second = [math]::Round((Get-Median @($measured | ForEach-Object {
        [double](Get-Field $_ @('predicted_per_second') 0) })), 2)
    $plural = if ($runs -eq 1) { 'run' } else { 'runs' }
    $result.detail = "$($result.prompt_tokens) prompt tokens at $($result.prompt_per_second) tok/s, " +
        "$($result.predicted_tokens) generated at $($result.predicted_per_second) tok/s (median of $runs $plural)"
    if ($result.predicted_tokens -ne $wanted) {
        $result.detail += "; asked for $wanted`: the server stopped early, ignore_eos is not honoured"
    }
    return $result
}

if ($module.Params.certify) {
    $toolCall = Test-ToolCall
    $module.Result.tool_call = @{
        ok = $toolCall.ok
        tool_use = $toolCall.tool_use
        tool_name = $toolCall.tool_name
        stop_reason = $toolCall.stop_reason
        final_stop_reason = $toolCall.final_stop_reason
        detail = $toolCall.detail
    }
    $module.Result.streams = @{
        openai = Test-OpenAIStream
        anthropic = Test-AnthropicStream
    }
    $throughput = Test-Throughput
    $module.Result.throughput = @{
        prompt_tokens = $throughput.prompt_tokens
        prompt_per_second = $throughput.prompt_per_second
        predicted_tokens = $throughput.predicted_tokens
        predicted_per_second = $throughput.predicted_per_second
        detail = $throughput.detail
    }
}

$module.Result.changed = $false
if ($problems.Count -gt 0) {
    $module.FailJson("$($baseUrl): $($problems -join '; ')")
}
$module.ExitJson()
