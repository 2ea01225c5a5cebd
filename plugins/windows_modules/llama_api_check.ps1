#!powershell

# The Windows twin of plugins/modules/llama_api_check.py (its DOCUMENTATION documents both): the same options, the same
# checks, the same failures and the same result fields, so the llama_verify role and the controller's verdict
# read one contract on both OSes. tests/unit/plugins/test_llama_api_check_contract.py compares the lists.
#
# RETURN (as llama_api_check.py's RETURN):
#   health: str
#   served_ids: list
#   openai: dict (object, completion_tokens, tokens_per_second, text)
#   anthropic: dict (type, output_tokens, stop_reason, text)
#   auth: dict (required, anonymous_status, wrong_key_status)

#AnsibleRequires -CSharpUtil Ansible.Basic

$spec = @{
    options = @{
        base_url = @{ type = 'str'; required = $true }
        model = @{ type = 'str'; required = $true }
        api_key = @{ type = 'str'; default = ''; no_log = $true }
        api_key_file = @{ type = 'str'; default = '' }
        prompt = @{ type = 'str'; default = 'Say hello in five words.' }
        max_tokens = @{ type = 'int'; default = 16 }
        timeout = @{ type = 'int'; default = 120 }
        chat = @{ type = 'bool'; default = $true }
    }
    supports_check_mode = $true
}
$module = [Ansible.Basic.AnsibleModule]::Create($args, $spec)

$textKept = 200
$baseUrl = $module.Params.base_url.TrimEnd('/')
$model = $module.Params.model
$apiKey = $module.Params.api_key
if (-not $apiKey -and $module.Params.api_key_file) {
    # The server's own key file, read on the host, so the key never leaves it.
    try {
        $apiKey = ([System.IO.File]::ReadAllLines($module.Params.api_key_file) | Select-Object -First 1).Trim()
    }
    catch {
        $module.Result.health = 'unknown'
        $module.FailJson("cannot read the key file $($module.Params.api_key_file): $($_.Exception.Message)")
    }
}
$timeoutMs = $module.Params.timeout * 1000

function Send-Request {
    # One request; returns @{ status = <int or $null>; body = <string>; error = <string or $null> }.
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
        $bytes = [System.Text.Encoding]::UTF8.GetBytes(($Body | ConvertTo-Json -Depth 8 -Compress))
        $request.ContentLength = $bytes.Length
    }
    $response = $null
    try {
        if ($null -ne $Body) {
            $stream = $request.GetRequestStream()
            $stream.Write($bytes, 0, $bytes.Length)
            $stream.Close()
        }
        $response = $request.GetResponse()
    }
    catch [System.Net.WebException] {
        if ($null -eq $_.Exception.Response) {
            return @{ status = $null; body = ''; error = $_.Exception.Message }
        }
        $response = $_.Exception.Response
    }
    catch {
        return @{ status = $null; body = ''; error = $_.Exception.Message }
    }
    try {
        $reader = New-Object System.IO.StreamReader($response.GetResponseStream(), [System.Text.Encoding]::UTF8)
        $text = $reader.ReadToEnd()
        $reader.Close()
        return @{ status = [int]$response.StatusCode; body = $text; error = $null }
    }
    finally {
        $response.Close()
    }
}

function Stop-Unreachable {
    # As the Linux module: a request that gets no usable answer fails the module with health "unreachable".
    param ([Parameter(Mandatory)][string]$Reason)
    foreach ($field in @('served_ids', 'openai', 'anthropic', 'auth')) {
        $null = $module.Result.Remove($field)
    }
    $module.Result.health = 'unreachable'
    $module.FailJson("$($baseUrl): $Reason")
}

function Invoke-Json {
    # A request that must answer 2xx with JSON; returns the decoded body.
    param (
        [Parameter(Mandatory)][string]$Path,
        [hashtable]$Headers = @{},
        [object]$Body = $null
    )
    $answer = Send-Request -Path $Path -Headers $Headers -Body $Body
    if ($null -ne $answer.error) {
        Stop-Unreachable "$Path`: $($answer.error)"
    }
    if ($answer.status -lt 200 -or $answer.status -ge 300) {
        Stop-Unreachable "$Path answered HTTP $($answer.status)"
    }
    if ([string]::IsNullOrWhiteSpace($answer.body)) {
        return [PSCustomObject]@{}
    }
    try {
        return $answer.body | ConvertFrom-Json
    }
    catch {
        Stop-Unreachable "$Path did not answer JSON"
    }
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

$openai = Invoke-Json -Path '/v1/chat/completions' -Headers $headers -Body $chat
$choice = @(Get-Field $openai @('choices') @()) | Select-Object -First 1
$module.Result.openai = @{
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

$module.Result.changed = $false
if ($problems.Count -gt 0) {
    $module.FailJson("$($baseUrl): $($problems -join '; ')")
}
$module.ExitJson()
